"""cancel(kv_cache) stops the calls running on that cache only, cancel() every call running at the
time, and neither ever stops a later call. It takes no lock, so a signal handler may call it on the
thread whose call it stops. Calls are held at chosen steps with events, so no outcome depends on
scheduling."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from conformance import BACKENDS, bundle, executor, reference
from litekv.errors import Cancelled
from litekv.kv_cache import KVCacheError

ARCH = "llama"
ALL = BACKENDS + ("numpy",)
PROMPT, STEPS, HELD = 5, 12, 4  # a held call stops before its model run at step HELD
WAIT = 60  # seconds: only a broken build waits this long


def get(backend: str):
    return reference(ARCH) if backend == "numpy" else executor(ARCH, backend, max_context=64)


def prefilled(ex):
    cache = ex.create_kv_cache()
    ex.prefill(np.arange(3, 3 + PROMPT), cache)
    return cache


class Gates:
    """Holds the sample_tokens call on each given cache before its model run at step HELD, until released."""

    def __init__(self, ex, caches):
        self.ex, self.original = ex, ex._sample
        self.reached = {id(c): threading.Event() for c in caches}
        self.release = {id(c): threading.Event() for c in caches}
        self.passed = {id(c): threading.Event() for c in caches}  # the held step's model run returned
        ex._sample = self._sample

    def _sample(self, tokens, kv_cache, *args):
        held = id(kv_cache) in self.reached and kv_cache.num_tokens == PROMPT + HELD
        if held:
            self.reached[id(kv_cache)].set()
            assert self.release[id(kv_cache)].wait(WAIT), "never released"
        try:
            return self.original(tokens, kv_cache, *args)
        finally:
            if held:
                self.passed[id(kv_cache)].set()

    def wait_reached(self, *caches) -> None:
        for c in caches:
            assert self.reached[id(c)].wait(WAIT), "a call never reached its held step"

    def let_through(self, cache) -> None:
        """Release `cache`'s call and wait until its held step's model run is over."""
        self.release[id(cache)].set()
        assert self.passed[id(cache)].wait(WAIT)

    def close(self) -> None:
        for event in self.release.values():
            event.set()
        del self.ex._sample


def in_thread(results: dict, name: str, call) -> threading.Thread:
    def run():
        try:
            results[name] = call()[0].tolist()
        except Exception as e:  # the outcome is asserted on
            results[name] = e
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def baseline(ex) -> list[int]:
    return ex.sample_tokens(STEPS, [8], prefilled(ex))[0].tolist()


def assert_continues_like(ex, cache, expected: list[int]) -> None:
    """A cancelled cache holds exactly the steps it committed: continuing it gives the uncancelled tokens."""
    done = cache.num_tokens - PROMPT
    assert done in (HELD, HELD + 1)  # its held step stopped inside the run, or completed and the next did not start
    last = expected[done - 1]
    assert expected[:done] + ex.sample_tokens(STEPS - done, [last], cache)[0].tolist() == expected


@pytest.mark.parametrize("first", ["cancelled", "other"])
@pytest.mark.parametrize("backend", ALL)
def test_cancel_of_one_cache_stops_only_the_call_on_it(backend, first):
    """Two calls are inside their step when one cache is cancelled; either then takes the model
    first (LiteRT's cancel flag is the whole model's): only the cancelled one stops."""
    ex = get(backend)
    expected = baseline(ex)
    target, other = prefilled(ex), prefilled(ex)
    gates, results = Gates(ex, (target, other)), {}
    try:
        threads = [in_thread(results, "target", lambda: ex.sample_tokens(STEPS, [8], target)),
                   in_thread(results, "other", lambda: ex.sample_tokens(STEPS, [8], other))]
        gates.wait_reached(target, other)
        ex.cancel(target)
        for cache in (target, other) if first == "cancelled" else (other, target):
            gates.let_through(cache)
    finally:
        gates.close()
        for thread in threads:
            thread.join(WAIT)
    assert isinstance(results["target"], Cancelled), results["target"]
    assert results["other"] == expected
    assert_continues_like(ex, target, expected)


@pytest.mark.parametrize("backend", ALL)
def test_cancel_of_every_call_does_not_reach_a_call_started_later(backend):
    """cancel() with no cache stops the two calls running; a third call, started while they are
    still inside their step, runs to the end."""
    ex = get(backend)
    expected = baseline(ex)
    first, second, later = prefilled(ex), prefilled(ex), prefilled(ex)
    gates, results = Gates(ex, (first, second)), {}
    try:
        threads = [in_thread(results, "first", lambda: ex.sample_tokens(STEPS, [8], first)),
                   in_thread(results, "second", lambda: ex.sample_tokens(STEPS, [8], second))]
        gates.wait_reached(first, second)
        ex.cancel()
        assert ex.sample_tokens(STEPS, [8], later)[0].tolist() == expected
    finally:
        gates.close()
        for thread in threads:
            thread.join(WAIT)
    assert isinstance(results["first"], Cancelled) and isinstance(results["second"], Cancelled)
    assert ex.sample_tokens(STEPS, [8], prefilled(ex))[0].tolist() == expected  # and none after them either


@pytest.mark.parametrize("backend", ALL)
def test_prefill_stops_for_its_own_cache_only(backend):
    ex = get(backend)
    cache, other = ex.create_kv_cache(), prefilled(ex)
    original, chunks = ex._run_prefill_chunk, []

    def chunk(tokens, plan, kv_cache, *args):
        original(tokens, plan, kv_cache, *args)
        chunks.append(plan)
        ex.cancel(other)  # another cache's: nothing of this call's
        if len(chunks) == 2:
            ex.cancel(kv_cache)

    ex._run_prefill_chunk = chunk
    ex._prefill_sizes = lambda: (4,)
    try:
        with pytest.raises(Cancelled):
            ex.prefill(np.arange(3, 23), cache)
    finally:
        del ex._run_prefill_chunk, ex._prefill_sizes
    assert cache.num_tokens == 8 and len(chunks) == 2
    ex.prefill(np.arange(11, 23), cache)  # the cache continues where the cancel left it
    assert cache.num_tokens == 20


def test_litert_interrupts_a_run_only_when_it_is_the_cancelled_calls():
    """While another cache's run holds the model, cancelling a waiting call leaves the model's
    cancel flag alone: the run in progress is not stopped."""
    ex = get("litert")
    waiting, running = prefilled(ex), prefilled(ex)
    gates, results, flags = Gates(ex, (waiting,)), {}, []
    original_run = ex._run

    def run(name, tokens, start, kv_cache, *args):
        if kv_cache is running and not flags:
            ex.cancel(waiting)  # waiting is inside its call, held before its model run
            flags.append(ex.model.cancel_requested)
        return original_run(name, tokens, start, kv_cache, *args)

    try:
        thread = in_thread(results, "waiting", lambda: ex.sample_tokens(STEPS, [8], waiting))
        gates.wait_reached(waiting)
        ex._run = run
        ex.step([8], running)
    finally:
        ex.__dict__.pop("_run", None)
        gates.close()
        thread.join(WAIT)
    assert flags == [False]
    assert isinstance(results["waiting"], Cancelled)


def test_cancel_takes_no_lock_a_running_call_may_hold():
    """A signal handler runs cancel() on the thread it interrupted, which may hold the executor's
    lock (a LoRA call's bookkeeping): cancel must not wait for it."""
    ex = get("numpy")
    cache = prefilled(ex)
    returned = threading.Event()

    def handler_on_a_busy_thread():
        with ex._call(None), ex._lock:
            ex.cancel()
            ex.cancel(cache)
            returned.set()

    thread = threading.Thread(target=handler_on_a_busy_thread, daemon=True)
    thread.start()
    assert returned.wait(WAIT), "cancel() waited for a lock its own thread holds"
    thread.join(WAIT)


SIGNAL_SCRIPT = textwrap.dedent("""
    import signal, sys
    sys.path.insert(0, {tests!r})
    from fake_executor import ScriptedExecutor
    from litekv.errors import Cancelled

    ex = ScriptedExecutor([5, 6, 7], vocab_size=16)
    cache = ex.create_kv_cache()
    ex.prefill([1, 2, 3], cache)
    signal.signal(signal.SIGUSR1, lambda *_: ex.cancel())  # what `litekv chat` does on Ctrl-C
    original = ex._sample

    def sample(tokens, kv_cache, *args):
        if kv_cache.num_tokens == 6:
            with ex._lock:  # the handler lands while this thread holds the executor's lock
                signal.raise_signal(signal.SIGUSR1)
        return original(tokens, kv_cache, *args)

    ex._sample = sample
    try:
        ex.sample_tokens(10, [4], cache)
    except Cancelled:
        print("cancelled at", cache.num_tokens)
""")


def test_cancel_from_a_signal_handler_on_the_running_thread():
    script = SIGNAL_SCRIPT.format(tests=str(Path(__file__).parent))
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=WAIT)
    except subprocess.TimeoutExpired:
        pytest.fail("the signal handler's cancel() deadlocked")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "cancelled at 7"  # the step in progress completes, the next does not start


LITERT_SCRIPT = textwrap.dedent("""
    import sys
    from litekv.errors import Cancelled
    from litekv.executor import open_executor

    ex = open_executor(sys.argv[1])
    cache = ex.create_kv_cache()
    ex.prefill([3, 4, 5], cache)
    original = ex._sample

    def sample(tokens, kv_cache, *args):
        ex.cancel(kv_cache)  # the model is idle: its flag stops the run this call starts
        return original(tokens, kv_cache, *args)

    ex._sample = sample
    try:
        ex.sample_tokens(4, [6], cache)
    except Cancelled as e:
        print(e)
""")


@pytest.mark.parametrize("level", [None, "error", "info"])
def test_litert_logs_nothing_for_opening_and_a_cancel_unless_asked(level):
    """LiteRT's INFO and WARNING lines (environment, accelerators, XNNPACK) and the ERROR it logs
    for a cancelled run stay off stderr unless LITEKV_LITERT_LOG asks for them."""
    env = {k: v for k, v in os.environ.items() if k != "LITEKV_LITERT_LOG"}
    if level:
        env["LITEKV_LITERT_LOG"] = level
    done = subprocess.run([sys.executable, "-c", LITERT_SCRIPT, str(bundle(ARCH, "litert"))], capture_output=True,
                          text=True, timeout=WAIT, env=env)
    assert done.returncode == 0, done.stderr
    assert "was cancelled" in done.stdout
    if level == "info":
        assert "INFO: " in done.stderr and "Failed to invoke" in done.stderr
    else:
        assert done.stderr == ""


def test_cancel_refuses_what_is_not_a_cache():
    ex = get("numpy")
    with pytest.raises(KVCacheError, match="cancel takes the KVCache"):
        ex.cancel("session")
    cache = prefilled(ex)
    ex.cancel(cache)  # nothing runs on it: a no-op
    assert ex.sample_tokens(2, [8], cache).shape == (1, 2)
