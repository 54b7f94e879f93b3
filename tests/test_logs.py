"""Log formats, klog verbosity and redaction, as an operator reads them."""

import io
import json
import logging

import pytest

from mvproxy import logs


@pytest.fixture
def capture():
    stream = io.StringIO()

    def configure(fmt="text", verbosity=2, static=None):
        logs.configure(fmt, verbosity, stream=stream, static=static)
        return stream

    yield configure
    logging.getLogger().handlers[:] = [
        h for h in logging.getLogger().handlers if not getattr(h, "_mvproxy", False)]


def test_text_lines_are_klog_like_with_key_values(capture):
    out = capture("text")
    logging.getLogger("mvproxy.polling").info(
        "peer became unreachable", extra=logs.kv(peer="apiserver-b", failures=3))
    line = out.getvalue().strip()
    assert line.startswith("I")
    assert line.endswith('mvproxy.polling] peer became unreachable peer="apiserver-b" failures=3')


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_workers_lines_say_which_worker(capture, fmt):
    out = capture(fmt, static={"worker": 1})
    logging.getLogger("mvproxy.app").info("serving", extra=logs.kv(port=6443))
    line = out.getvalue().strip()
    if fmt == "json":
        assert json.loads(line)["worker"] == 1
    else:
        assert line.endswith("serving port=6443 worker=1")


def test_json_lines_carry_level_verbosity_logger_and_fields(capture):
    out = capture("json", verbosity=4)
    logging.getLogger("mvproxy.routing").log(logs.V(4), "routed", extra=logs.kv(route="peer"))
    doc = json.loads(out.getvalue())
    assert doc["level"] == "info" and doc["v"] == 4
    assert doc["logger"] == "mvproxy.routing" and doc["msg"] == "routed"
    assert doc["route"] == "peer"


@pytest.mark.parametrize("verbosity,shown", [(2, False), (4, True), (10, True)])
def test_verbosity_hides_higher_v_levels(capture, verbosity, shown):
    out = capture("text", verbosity)
    logging.getLogger("mvproxy.routing").log(logs.V(4), "per-request decision")
    assert ("per-request decision" in out.getvalue()) is shown


def test_warnings_and_errors_use_klog_letters(capture):
    out = capture("text")
    logging.getLogger("mvproxy.x").warning("w")
    logging.getLogger("mvproxy.x").error("e")
    first, second = out.getvalue().splitlines()
    assert first.startswith("W") and second.startswith("E")


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_bearer_tokens_and_private_keys_never_reach_the_log(capture, fmt):
    out = capture(fmt)
    secret = "eyJhbGciOiJSUzI1NiJ9.secret-token-value"
    pem = "-----BEGIN PRIVATE KEY-----\nMIGHAgEAMBMGByqGSM49\n-----END PRIVATE KEY-----"
    log = logging.getLogger("mvproxy.transport")
    log.warning("upstream said: Authorization: Bearer %s", secret,
                extra=logs.kv(authorization=f"Bearer {secret}", detail=pem))
    try:
        raise ValueError(f"bad header Bearer {secret}")
    except ValueError:
        log.exception("failed")
    text = out.getvalue()
    assert secret not in text
    assert "MIGHAgEAMBMGByqGSM49" not in text
    assert logs.REDACTED in text


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_secrets_inside_structured_values_and_secret_named_keys_are_masked(capture, fmt):
    out = capture(fmt)
    logging.getLogger("mvproxy.x").info("request", extra=logs.kv(
        headers={"Authorization": "Bearer s3cr3t-value"}, peer_token="t0k3n-value",
        basic="Basic dXNlcjpwYXNzd29yZA=="))
    text = out.getvalue()
    for secret in ("s3cr3t-value", "t0k3n-value", "dXNlcjpwYXNzd29yZA=="):
        assert secret not in text


def test_throttle_logs_once_per_interval_and_counts_what_it_left_out(caplog):
    """Request-path warnings: one line per message per interval, whatever the request
    rate; the next line says how many were left out."""
    from mvproxy.logs import Throttle

    now = [0.0]
    throttle = Throttle(interval=60.0, clock=lambda: now[0])
    logger = logging.getLogger("mvproxy.test.throttle")
    with caplog.at_level(logging.WARNING, logger="mvproxy.test.throttle"):
        logged = [throttle.warning(logger, "backend down", error="refused") for _ in range(100)]
        throttle.warning(logger, "another message")
        now[0] = 61.0
        throttle.warning(logger, "backend down", error="refused")
    assert logged.count(True) == 1
    lines = [r for r in caplog.records if r.name == "mvproxy.test.throttle"]
    assert [r.getMessage() for r in lines] == ["backend down", "another message", "backend down"]
    assert kv_fields(lines[2])["suppressed_since_last"] == 99
    assert "suppressed_since_last" not in kv_fields(lines[0])


def kv_fields(record: logging.LogRecord) -> dict:
    return getattr(record, logs._KV_ATTR, {})
