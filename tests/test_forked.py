"""Engine processes forked from an actor start as spawned ones would (actors/forked.py)."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import threading

from actors import forked


def _report(conn) -> None:
    """In the forked child: what it inherited (the wake-up fd, left in place, and the SIGINT and
    SIGTERM handlers); then SIGTERM to itself, which must end it."""
    old = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(old)
    conn.send((old, signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
               signal.getsignal(signal.SIGINT) is signal.default_int_handler))
    conn.close()
    os.kill(os.getpid(), signal.SIGTERM)


def test_a_child_forked_from_an_actor_has_no_part_in_its_event_loops_signals():
    """An actor's event loop handles SIGTERM through a wake-up fd and no-op Python handlers
    (loop.add_signal_handler). A child forked as an engine process must not keep them: its
    SIGTERM would be written into the actor's loop (stopping the actor) and the inherited no-op
    handler would make the child ignore it. Forked from a worker thread, as engines are."""
    got_sigterm = []

    async def main():
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, lambda: got_sigterm.append(True))
        forked.enable()
        parent, child = multiprocessing.Pipe(duplex=False)
        proc = multiprocessing.get_context("fork").Process(target=_report, args=(child,))

        def run() -> tuple:
            proc.start()
            child.close()
            inherited = parent.recv()
            proc.join(30)
            return inherited

        inherited = await asyncio.to_thread(run)
        loop.remove_signal_handler(signal.SIGTERM)
        return inherited, proc.exitcode

    (wakeup_fd, term_default, int_default), exitcode = asyncio.run(main())
    assert wakeup_fd == -1, "the child inherited the actor loop's signal wake-up fd"
    assert term_default and int_default, "the child inherited the actor loop's signal handlers"
    assert exitcode == -signal.SIGTERM, "the child's SIGTERM did not end it"
    assert got_sigterm == []


def test_no_log_line_is_half_written_while_an_engine_process_forks():
    """Between fork's before and after hooks every logging handler's lock is held, so no other
    thread is inside a handler's write to its stream when the child is made (the stream's own
    lock would stay taken in the child, whose first write would then hang)."""
    handler = logging.StreamHandler()
    logging.getLogger("tether-test-forked").addHandler(handler)
    free = []
    other = lambda: free.append(handler.lock.acquire(blocking=False)) or (free[-1] and
                                                                           handler.lock.release())
    forked._hold_handlers()
    try:
        t = threading.Thread(target=other)
        t.start()
        t.join()
    finally:
        forked._release_handlers()
    t = threading.Thread(target=other)
    t.start()
    t.join()
    logging.getLogger("tether-test-forked").removeHandler(handler)
    assert free == [False, True]
