module mvproxy.bench/watchload

go 1.24
