-- wrk reporting hook for bench/run.py: one JSON line with exact percentiles.
done = function(summary, latency, requests)
  local errors = summary.errors
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "bytes": %d, "connect_errors": %d, ' ..
    '"read_errors": %d, "write_errors": %d, "status_errors": %d, "timeouts": %d, ' ..
    '"p50_us": %d, "p90_us": %d, "p99_us": %d, "p999_us": %d}\n',
    summary.requests, summary.duration, summary.bytes, errors.connect, errors.read,
    errors.write, errors.status, errors.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9)))
end
