-- wrk script for bench/real_cost.py: each thread stops after BENCH_REQUESTS_PER_THREAD
-- answers and says so on stdout; the bench then interrupts wrk (SIGINT), which ends the
-- run at once (wrk would otherwise sleep out its -d) and still reports: so a run is a
-- fixed request count, not a duration. BENCH_REPORT_LUA names bench/run.py's reporting
-- hook, which prints the one JSON line.
dofile(os.getenv("BENCH_REPORT_LUA"))

local answered = 0
local limit = tonumber(os.getenv("BENCH_REQUESTS_PER_THREAD") or "0")

response = function(status, headers, body)
  answered = answered + 1
  if limit > 0 and answered == limit then
    io.write("BENCH-LIMIT\n")
    io.flush()
    wrk.thread:stop()
  end
end
