"""Engine processes forked from an actor start as spawned ones would (actors/forked.py)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal

from actors.forked import reset_in_children


def _report(conn) -> None:
    """In the forked child: what it inherited (the old wake-up fd and the SIGTERM handler)."""
    conn.send((signal.set_wakeup_fd(-1), signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
               signal.getsignal(signal.SIGINT) is signal.default_int_handler))
    conn.close()
    os.kill(os.getpid(), signal.SIGTERM)  # the default action: this child ends here


def test_a_child_forked_from_an_actor_has_no_part_in_its_event_loops_signals():
    """An actor's event loop handles SIGTERM through a wake-up fd and no-op Python handlers
    (loop.add_signal_handler). A child forked as an engine process must not keep them: its
    SIGTERM would be written into the actor's loop (stopping the actor) and the inherited no-op
    handler would make the child ignore it. Forked from a worker thread, as engines are."""
    got_sigterm = []

    async def main():
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, lambda: got_sigterm.append(True))
        reset_in_children()
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
    assert exitcode == -signal.SIGTERM
    assert got_sigterm == []
