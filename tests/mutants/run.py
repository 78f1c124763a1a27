"""Apply plausible one-line bugs to a copy of the repository and check that the suite notices.

Each mutant names a file, a snippet of its source that must occur exactly once, the snippet's
replacement, and the tests that must fail once it is applied. For each mutant the script writes
the mutated file into a temporary copy of the working tree (the working tree itself is never
touched), runs the named tests there with ``PYTHONPATH`` pointed at the copy, and prints a table:

- ``caught``: the tests failed on the mutant (and passed on the unmutated copy);
- ``NOT caught``: they passed on the mutant;
- ``caught only by the timeout``: they failed only because pytest-timeout cut a hang;
- ``site not found`` / ``site ambiguous``: the snippet occurs 0 or several times (the code moved:
  update the mutant);
- ``pending``: a mutant of a fix not on this branch yet, whose site is not found (not a failure).

Exit status: 0 when every mutant is caught (or pending), 1 otherwise, 2 when a named test fails
on the unmutated copy (the table would mean nothing).

Usage: ``python tests/mutants/run.py [--only NAME]... [--list]``. PostgreSQL comes from
``WEFT_SYNC_TEST_POSTGRES_DSN`` or a throwaway cluster started once for the whole run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PER_RUN_TIMEOUT_S = 900
TEST_TIMEOUT_S = 60
"""pytest-timeout per test inside a mutant run: a hang shows up as such, quickly."""


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    find: str
    replace: str
    tests: tuple[str, ...]
    pending: str | None = None
    """Why the site may be missing on this branch (a fix another branch brings)."""


_SHORT = "tests/fencing/test_proven_connection_takeover.py"
_ENDED = "tests/fencing/test_ended_inside.py"
_CLOCK_FAILURE = "tests/claims/test_takeover_clock_failure.py"
_TARGET = "tests/maintenance/test_reclaim_target.py"
MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "sqlite3 proven block accepts a newer epoch (>= for ==)",
        "weft_sync/fencing/sqlite3.py",
        "if first_value(row) != expected:",
        "if first_value(row) < expected:",
        (
            f"{_SHORT}::test_a_deposed_owners_write_on_its_proven_connection_is_refused_and_"
            "nothing_commits[sqlite-sqlite3]",
        ),
    ),
    Mutant(
        "generic fence accepts a newer epoch (psycopg, psycopg2, SQLAlchemy)",
        "weft_sync/fencing/core.py",
        "        if observed != expected:\n",
        "        if observed is None or observed < expected:\n",
        (
            f"{_SHORT}::test_a_deposed_owners_write_on_its_proven_connection_is_refused_and_"
            "nothing_commits",
        ),
    ),
    Mutant(
        "handler driven without the held-claim guard",
        "weft_sync/ownership/handler_table.py",
        "if epoch is None or record is None",
        "if record is None",
        ("tests/test_handler_guard.py",),
    ),
    Mutant(
        "sqlite3 proven block commits between its check and the host's write",
        "weft_sync/fencing/sqlite3.py",
        "        self._expected = expected\n        return conn\n",
        "        self._expected = expected\n"
        '        cursor.execute("COMMIT")\n        cursor.execute("BEGIN")\n'
        "        return conn\n",
        (
            f"{_SHORT}::test_a_takeover_during_the_window_between_check_and_write_never_"
            "interleaves[sqlite3]",
        ),
    ),
    Mutant(
        "PostgreSQL sessions run without statement_timeout",
        "weft_sync/storage/postgres/settings.py",
        '    wanted = {\n        "statement_timeout": bounds.statement_timeout_ms,\n',
        "    wanted = {\n",
        ("tests/storage/test_statement_cut.py",),
    ),
    Mutant(
        "takeover keeps the old engine's by-engine entry",
        "weft_sync/claims/engine_index.py",
        "if previous is None or previous.engine_id == engine_id:",
        "if True:",
        (
            "tests/reliability/test_model.py::"
            "test_three_registries_on_one_store_follow_the_claim_rules",
        ),
    ),
    Mutant(
        "WaitDeadline ignores its deadline",
        "weft_sync/storage/wait_bound.py",
        "return min(natural, self._deadline)",
        "return natural",
        ("tests/storage/test_wait_deadline_bound.py",),
    ),
    Mutant(
        "SQLite reads a few keys by lookup and keeps only the first one found",
        "weft_sync/storage/sqlite/writer.py",
        "point[key] = None if row is None else as_bytes(row[0])",
        "point.setdefault(key, None if point else as_bytes(row[0]) if row else None)",
        ("tests/storage/test_contract.py::test_conditions_on_any_number_of_keys_are_each_judged",),
    ),
    Mutant(
        "SQLite read_then_write trusts a condition on a key it read",
        "weft_sync/storage/sqlite/writer.py",
        "if any(c.key in known and known[c.key] != c.expected for c in conditions):",
        "if False:",
        (
            "tests/storage/test_read_then_write.py::"
            "test_a_condition_on_a_key_read_is_judged_against_the_value_read",
        ),
    ),
    Mutant(
        "PostgreSQL read_then_write reads without locking the rows",
        "weft_sync/storage/postgres/cas.py",
        "statement, params = self._q.lock_rows(keys)",
        "statement, params = self._q.get_many, [keys]",
        (
            "tests/storage/test_read_then_write.py::"
            "test_postgres_decide_runs_with_the_rows_read_locked",
        ),
    ),
    Mutant(
        "a deposed owner's finish checks the status before the epoch",
        "weft_sync/ledger/finishing.py",
        "                self._check_still_owner(wid, preparation)\n"
        "                raise WorkflowStateError(",
        "                raise WorkflowStateError(",
        ("tests/workflows/test_deposed_finish.py",),
    ),
    Mutant(
        "the handler executor counts a woken thread as free for the next run too",
        "weft_sync/ownership/handler_executor.py",
        "if self._idle < len(self._queue) and len(self._threads) < self._workers:",
        "if self._idle == 0 and len(self._threads) < self._workers:",
        (
            "tests/test_handler_executor.py::"
            "test_a_run_queued_right_after_a_hanging_one_gets_a_thread_of_its_own",
        ),
    ),
    Mutant(
        "wait_idle() waits on the handler threads' condition",
        "weft_sync/ownership/handler_executor.py",
        "                self._settled.wait(remaining)",
        "                self._cond.wait(remaining)",
        (
            "tests/test_handler_executor.py::"
            "test_a_run_submitted_while_run_maintenance_waits_reaches_the_idle_thread",
        ),
    ),
    Mutant(
        "a reclaim requested while the slot is busy waits for the next tick",
        "weft_sync/maintenance/task.py",
        "                relaunch.append((kind, self._new_driver(kind)))",
        "                pass",
        (
            "tests/maintenance/test_reclaim_requests.py::"
            "test_a_request_made_while_the_slot_reports_its_result_is_followed_by_a_reclaim",
        ),
    ),
    Mutant(
        "a decide's BaseException fails the whole group of the SQLite writer",
        "weft_sync/storage/sqlite/writer.py",
        "        except BaseException as exc:\n"
        "            # A BaseException too (SystemExit from host code)",
        "        except Exception as exc:\n"
        "            # A BaseException too (SystemExit from host code)",
        ("tests/storage/test_writer_thread.py",),
    ),
    Mutant(
        "a claim waiter's pause ignores a crash noted before it began",
        "weft_sync/reclaim/crash_detection.py",
        "self._death.wait_for(lambda: self._deaths != seen, timeout)",
        "self._death.wait(timeout)",
        (
            "tests/liveness/test_death_waits.py::"
            "test_a_crash_noted_after_the_waiters_look_ends_its_next_pause_at_once",
        ),
    ),
    Mutant(
        "a deposed claim's loss report stops at a host BaseException",
        "weft_sync/claims/renewals.py",
        "                interrupted = interrupted or exc",
        "                raise",
        (
            "tests/claims/test_lost_report_interrupted.py::"
            "test_a_baseexception_from_on_lost_still_lets_the_other_lost_claims_be_reported",
        ),
    ),
    Mutant(
        "a deadline loss report stops at a host BaseException",
        "weft_sync/claims/losses.py",
        "                interrupted = interrupted or exc",
        "                raise",
        (
            "tests/claims/test_lost_report_interrupted.py::"
            "test_a_baseexception_from_on_lost_at_the_deadline_lets_the_others_be_reported",
        ),
    ),
    Mutant(
        "the PostgreSQL deadline watcher dies on a failed cancel",
        "weft_sync/storage/postgres/deadline.py",
        "                except BaseException:",
        "                except ZeroDivisionError:",
        (
            "tests/storage/test_call_deadlines.py::"
            "test_a_cancel_that_raises_leaves_the_watcher_running_and_the_call_returning",
        ),
    ),
    Mutant(
        "PostgreSQL call deadlines count the time the process was stopped",
        "weft_sync/storage/postgres/deadline.py",
        "entry.deadline += max(0.0, min(lost, now - entry.began))",
        "entry.deadline += 0.0",
        (
            "tests/storage/test_call_deadlines.py::"
            "test_a_stopped_and_continued_process_does_not_cancel_its_calls",
        ),
    ),
    Mutant(
        "a call's block ends while the watcher's cancel of it is still under way",
        "weft_sync/storage/postgres/deadline.py",
        "while entry is not None and entry.busy:",
        "while entry is not None and entry.busy and False:",
        (
            "tests/storage/test_call_deadlines.py::"
            "test_a_call_block_ends_only_once_its_cancel_is_over",
        ),
    ),
    Mutant(
        "a clock error after a takeover commit leaves the holders untracked",
        "weft_sync/claims/takeovers.py",
        "        except Exception:\n            # Committed already",
        "        except ZeroDivisionError:\n            # Committed already",
        (
            f"{_CLOCK_FAILURE}::test_a_clock_error_after_the_commit_keeps_the_takeover_tracked",
            f"{_CLOCK_FAILURE}::"
            "test_a_clock_error_after_a_batched_commit_keeps_every_takeover_tracked",
        ),
    ),
    Mutant(
        "a clock exit after a takeover commit gives nothing back",
        "weft_sync/claims/takeovers.py",
        "            self._give_back_all(won)\n            raise",
        "            raise",
        (
            f"{_CLOCK_FAILURE}::test_a_clock_exit_after_the_commit_gives_the_takeover_back",
            f"{_CLOCK_FAILURE}::test_a_clock_exit_after_a_batched_commit_gives_every_takeover_back",
        ),
    ),
    Mutant(
        "a batched takeover's install loop stops at the first claim a close gave back",
        "weft_sync/claims/takeovers.py",
        "                except Exception as exc:\n                    # Its own outcome",
        "                except ZeroDivisionError as exc:\n                    # Its own outcome",
        (
            "tests/claims/test_registry_close.py::"
            "test_a_batched_takeover_that_outlives_the_close_timeout_gives_every_claim_back",
        ),
    ),
    Mutant(
        "a clock error after a takeover leaves the claim undriven",
        "weft_sync/reclaim/target.py",
        "self._keep_pending(workflow_id, result.epoch)\n                    raise",
        "raise",
        (f"{_TARGET}::test_a_clock_error_after_a_takeover_keeps_the_claim_for_a_redrive",),
    ),
    Mutant(
        "an exit in the batched re-check read leaves the won claims undriven",
        "weft_sync/reclaim/target.py",
        "                    self._keep_pending(wid, first.epoch)",
        "                    pass",
        (
            f"{_TARGET}::"
            "test_an_exit_in_the_batched_re_check_read_keeps_the_won_claims_for_a_redrive",
        ),
    ),
    Mutant(
        "the liveness watcher dies on a BaseException from a step",
        "weft_sync/reclaim/watcher.py",
        "        except BaseException:\n            # Whatever host code",
        "        except Exception:\n            # Whatever host code",
        (
            "tests/liveness/test_watcher_base_exceptions.py::"
            "test_a_probe_that_raises_system_exit_is_logged_and_the_watching_goes_on",
        ),
    ),
    Mutant(
        "the liveness watcher stops reporting at an on_dead that raises SystemExit",
        "weft_sync/reclaim/watcher.py",
        "            except BaseException as exc:\n                # SystemExit and the like too",
        "            except Exception as exc:\n                # SystemExit and the like too",
        (
            "tests/liveness/test_watcher_base_exceptions.py::"
            "test_an_on_dead_that_raises_system_exit_is_logged_and_the_others_are_reported",
        ),
    ),
    Mutant(
        "the liveness watcher logs a dead engine before reporting it",
        "weft_sync/reclaim/watcher.py",
        "        self._reported.update(fresh)\n",
        "        self._reported.update(fresh)\n"
        "        for engine in fresh:\n"
        '            _log.info("engine %s lost its session lock: reported dead", engine)\n',
        (
            "tests/liveness/test_watcher_base_exceptions.py::test_a_log_handler_that_raises_costs_no_report",
        ),
    ),
    Mutant(
        "the crash path logs before it asks for the reclaim",
        "weft_sync/reclaim/crash_detection.py",
        "    def on_dead(dead_engine: str) -> None:\n",
        "    def on_dead(dead_engine: str) -> None:\n"
        '        _log.info("weft_sync: engine %s is gone; reclaiming its claims now", '
        "dead_engine)\n",
        (
            "tests/test_crash_fast_path.py::"
            "test_a_killed_engines_claims_move_through_the_crash_probe",
        ),
    ),
    Mutant(
        "a maintenance slot ended by SystemExit says nothing",
        "weft_sync/maintenance/task.py",
        "        except BaseException:\n            # SystemExit and the like from host code",
        "        except Exception:\n            # SystemExit and the like from host code",
        (
            "tests/maintenance/test_interval.py::"
            "test_a_slot_ended_by_system_exit_from_host_code_is_logged_and_runs_again",
        ),
    ),
    Mutant(
        "the generic block commits without its end check (psycopg2, SQLAlchemy, Django)",
        "weft_sync/fencing/core.py",
        "        _end_check(self._fence, host, binding, self._wid, self._expected)\n",
        "",
        (
            f"{_ENDED}::test_psycopg2_commit_inside_then_a_takeover_commits_nothing_after_it",
            f"{_ENDED}::test_sqlalchemy_commit_inside_then_a_takeover_commits_nothing_after_it",
        ),
    ),
    Mutant(
        "psycopg2 after its explicit BEGIN commits without the end check",
        "weft_sync/fencing/psycopg2.py",
        "self.query(binding.commit_checked, ())",
        'self.query("COMMIT", ())',
        (f"{_ENDED}::test_psycopg2_commit_statement_inside_is_reported",),
    ),
    Mutant(
        "the psycopg 3 proven block in psycopg's transaction block commits without its end check",
        "weft_sync/fencing/psycopg.py",
        "        if observed != self._expected:\n            _exit_quietly(",
        "        if False:\n            _exit_quietly(",
        (f"{_ENDED}::test_psycopg_commit_statement_inside_then_a_takeover",),
    ),
    Mutant(
        "the psycopg 3 proven block in its implicit transaction commits without the end check",
        "weft_sync/fencing/psycopg.py",
        "cur.execute(self._commit, prepare=False)",
        'cur.execute("COMMIT", prepare=False)',
        (
            f"{_ENDED}::test_psycopg_commit_statement_inside_then_a_takeover",
            f"{_ENDED}::test_psycopg_commit_call_inside_is_refused_by_psycopg_or_by_the_block",
        ),
    ),
    Mutant(
        "the psycopg 3 proven block ends quietly when the host ended its implicit transaction",
        "weft_sync/fencing/psycopg.py",
        "            raise ended_inside(self._wid)  # the host's",
        "            return  # the host's",
        (
            "tests/fencing/test_psycopg_block.py::test_commit_inside_a_proven_block_commits_nothing_after_it",
        ),
    ),
    Mutant(
        "the sqlite3 proven block commits without its end check",
        "weft_sync/fencing/sqlite3.py",
        "        if observed != self._expected:\n            _rollback_quietly(",
        "        if False:\n            _rollback_quietly(",
        (f"{_ENDED}::test_sqlite3_commit_inside_then_a_takeover_commits_nothing_after_it",),
    ),
)


def _copy_tree(dest: Path) -> None:
    """Copy the working tree's tracked and untracked-but-not-ignored files into ``dest``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for raw in listed:
        if not raw:
            continue
        rel = raw.decode()
        src = ROOT / rel
        if not src.is_file():
            continue  # deleted in the working tree
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def _run_tests(copy: Path, tests: tuple[str, ...], env: dict[str, str]) -> tuple[int, str]:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-x",
        "-n",
        "0",  # stop at the first failure, in one process
        "-p",
        "no:cacheprovider",
        "-o",
        f"timeout={TEST_TIMEOUT_S}",
        *tests,
    ]
    try:
        proc = subprocess.run(
            cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=PER_RUN_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else ""
        return -1, out + "\n[the whole run timed out]"
    return proc.returncode, proc.stdout + proc.stderr


def _verdict(code: int, output: str) -> str:
    if code == 0:
        return "NOT caught"
    if code == -1 or "+++ Timeout +++" in output:
        return "caught only by the timeout"
    if code == 1:
        return "caught"
    return f"error (pytest exit {code})"


def _tail(output: str, lines: int = 15) -> str:
    return "\n".join("    " + line for line in output.strip().splitlines()[-lines:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--only", action="append", default=[], help="substring of mutant names")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = parser.parse_args(argv)
    mutants = [m for m in MUTANTS if not args.only or any(s in m.name for s in args.only)]
    if args.list:
        for m in mutants:
            print(f"{m.name}: {m.path} -> {' '.join(m.tests)}")
        return 0
    if not mutants:
        print("no mutant matches --only", file=sys.stderr)
        return 2

    sys.path.insert(0, str(ROOT))
    cluster = None
    env = dict(os.environ)
    env.pop("PYTEST_ADDOPTS", None)
    if not env.get("WEFT_SYNC_TEST_POSTGRES_DSN"):
        from tests.pgcluster import start_cluster

        cluster = start_cluster()
        env["WEFT_SYNC_TEST_POSTGRES_DSN"] = cluster.url
    rows: list[tuple[str, str, str]] = []
    failed = False
    try:
        with tempfile.TemporaryDirectory(prefix="weft-mutants-") as tmp:
            copy = Path(tmp) / "repo"
            _copy_tree(copy)
            env["PYTHONPATH"] = str(copy)
            runnable: list[Mutant] = []
            for m in mutants:
                source = copy / m.path
                count = source.read_text().count(m.find) if source.exists() else 0
                if count == 1:
                    runnable.append(m)
                elif count == 0 and m.pending:
                    rows.append((m.name, "pending", f"site not found: {m.pending}"))
                else:
                    what = "site not found" if count == 0 else f"site ambiguous ({count} matches)"
                    rows.append((m.name, what, f"{m.path}: {m.find!r}"))
                    failed = True
            # The named tests must pass on the unmutated copy, or the table means nothing.
            baseline = tuple(dict.fromkeys(t for m in runnable for t in m.tests))
            if baseline:
                code, output = _run_tests(copy, baseline, env)
                if code != 0:
                    print(f"the named tests fail on the UNMUTATED code (exit {code}):")
                    print(_tail(output, 30))
                    return 2
            for m in runnable:
                target = copy / m.path
                original = target.read_text()
                target.write_text(original.replace(m.find, m.replace, 1))
                start = time.monotonic()
                try:
                    code, output = _run_tests(copy, m.tests, env)
                finally:
                    target.write_text(original)
                verdict = _verdict(code, output)
                took = f"{time.monotonic() - start:.1f} s"
                rows.append((m.name, verdict, f"{took}; {' '.join(m.tests)}"))
                if verdict != "caught":
                    failed = True
                    print(f"--- {m.name}: {verdict}\n{_tail(output)}", file=sys.stderr)
    finally:
        if cluster is not None:
            cluster.stop()
    width = max(len(name) for name, _, _ in rows)
    vwidth = max(len(verdict) for _, verdict, _ in rows)
    print(f"| {'mutant'.ljust(width)} | {'verdict'.ljust(vwidth)} | detail |")
    print(f"|{'-' * (width + 2)}|{'-' * (vwidth + 2)}|--------|")
    order = {m.name: n for n, m in enumerate(MUTANTS)}
    for name, verdict, detail in sorted(rows, key=lambda row: order[row[0]]):
        print(f"| {name.ljust(width)} | {verdict.ljust(vwidth)} | {detail} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
