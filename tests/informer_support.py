"""The client-go informer that ``scripts/dev.py kube-binaries`` builds
(``tests/realk8s/informer``), run as a child process whose JSON lines a test waits on.

``informer_binary(version)`` finds the binary built against that Kubernetes version's
client-go, skipping the test when it is absent, or failing it when ``CI`` is set (CI
builds it). :class:`Informer` starts it with ``--exit-on-stdin-eof`` (if the test dies,
the pipe closes and the informer exits), reads its stdout on a thread, and waits a
bounded time for a line; ``stop()`` closes stdin, waits for the ``STOPPED`` line and
kills the process if it does not come.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from e2e_support import WAIT_TIMEOUT, LineReader, stop_popen
from scripts_support import script

kube_binaries = script("kube_binaries")

STOP_TIMEOUT = 10.0


def informer_binary(version: str) -> Path:
    """The cached informer for ``version``; skip (fail in CI) when it is not built."""
    found = kube_binaries.find_informer(version)
    if found is not None:
        return Path(found)
    why = (f"no informer built for {version} under {kube_binaries.cache_root()} "
           f"(python3 scripts/dev.py kube-binaries {version})")
    if os.environ.get("CI"):
        pytest.fail(f"{why}; CI is set, so it must have been built")
    pytest.skip(why)


class Informer:
    """One running informer. ``lines`` holds every parsed line read so far."""

    def __init__(self, binary: Path, *, kubeconfig: Path, context: str, resource: str,
                 group: str = "", version: str = "v1", namespace: str = "",
                 extra_args: Sequence[str] = (), env: dict[str, str] | None = None,
                 stderr_path: Path | None = None, duration: str = "300s") -> None:
        argv = [str(binary), "--kubeconfig", str(kubeconfig), "--context", context,
                "--group", group, "--version", version, "--resource", resource,
                "--namespace", namespace, "--exit-on-stdin-eof",
                "--duration", duration,  # a backstop; the test stops it long before
                *extra_args]
        self.stderr_path = stderr_path
        stderr = open(stderr_path, "w") if stderr_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=stderr, text=True, env=env)
        finally:
            if stderr_path:
                stderr.close()  # type: ignore[union-attr]
        self.reader = LineReader(self.proc)
        self.lines: list[dict[str, Any]] = []

    def wait_for(self, kind: str, timeout: float = WAIT_TIMEOUT, **fields: Any) -> dict[str, Any]:
        """The next line of type ``kind`` whose ``fields`` match; AssertionError (with
        everything printed) if none comes within ``timeout``."""

        def parse(line: str) -> bool:
            doc = json.loads(line)
            self.lines.append(doc)
            return doc.get("type") == kind and all(doc.get(k) == v for k, v in fields.items())

        try:
            return json.loads(self.reader.wait_for(parse, timeout))
        except AssertionError as exc:
            raise AssertionError(f"no {kind} {fields or ''} line: {exc}{self._stderr()}") from None

    def of_type(self, *kinds: str) -> list[dict[str, Any]]:
        return [line for line in self.lines if line.get("type") in kinds]

    def read_rest(self) -> list[dict[str, Any]]:
        """After ``stop()``: every line not waited for yet, parsed into ``lines`` too
        (so ``of_type`` covers the whole run)."""
        rest = []
        while True:
            try:
                line = self.reader.lines.get_nowait()
            except queue.Empty:
                break
            if line is None:
                break
            self.reader.seen.append(line)
            rest.append(json.loads(line))
        self.lines.extend(rest)
        return rest

    def _stderr(self) -> str:
        if self.stderr_path is None or not self.stderr_path.exists():
            return ""
        tail = self.stderr_path.read_text(errors="replace").splitlines()[-20:]
        return "\n--- informer stderr (tail)\n" + "\n".join(tail)

    def stop(self) -> int | None:
        """Close stdin; the informer prints STOPPED and exits. Killed if it does not
        within STOP_TIMEOUT. Returns its exit status (None if it had to be killed)."""
        try:
            if self.proc.stdin is not None and not self.proc.stdin.closed:
                self.proc.stdin.close()
            try:
                return self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                return None
        finally:
            stop_popen(self.proc, self.reader)
