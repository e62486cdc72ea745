#!/usr/bin/env bash
# CPython 3.11's own multiprocessing test suite (Lib/test/_test_multiprocessing.py)
# against nimbus.multiprocessing, scored against the stdlib baseline. See README.md.
#
#   bench/transparency/run.sh                     # full score run, flavours processes,manager,misc (~7-8 min)
#   FAST=1 bench/transparency/run.sh              # fast subset (< 2 min); exit 1 if a test in it fails
#   bench/transparency/run.sh -k TestSimpleQueue  # extra run_suite.py options are passed on
#   RUN=1 bench/transparency/run.sh               # the suite unrewritten (`import multiprocessing`),
#                                                 # every interpreter started as `nimbus run`
#
# Env: HARNESS (default <repo>/../shared/transparency), BASELINE (stdlib baseline JSON),
#      FLAVOURS (processes,manager,misc), TIMEOUT (per test; 60 s, FAST: 20 s), BUDGET (overall s,
#      default 1500), OUT (directory for the JSON results; default a temp dir, printed at the end).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HARNESS="${HARNESS:-$REPO/../shared/transparency}"
BASELINE="${BASELINE:-$HARNESS/baseline/stdlib-3.11.7.json}"
FLAVOURS="${FLAVOURS:-processes,manager,misc}"
if [ "${FAST:-0}" = 1 ]; then TIMEOUT="${TIMEOUT:-20}"; else TIMEOUT="${TIMEOUT:-60}"; fi
BUDGET="${BUDGET:-1500}"
PY="$REPO/.venv/bin/python"

[ -x "$PY" ] || { echo "no venv python at $PY" >&2; exit 2; }
[ -f "$HARNESS/run_suite.py" ] || { echo "no harness at $HARNESS" >&2; exit 2; }

# The harness writes gen/ and results/ next to itself, and is read-only where it is: copy it.
WORK="$(mktemp -d /tmp/nimbus-transparency.XXXXXX)"
cp -r "$HARNESS/." "$WORK/"
chmod -R u+w "$WORK"
OUT="${OUT:-$WORK/results}"
mkdir -p "$OUT"

TAG=score
ARGS=()
CANDIDATE=nimbus.multiprocessing
if [ "${RUN:-0}" = 1 ]; then
    # the stdlib's names, aliased to nimbus by `nimbus run` in every worker interpreter
    CANDIDATE=multiprocessing
    printf '#!/bin/sh\nexec "%s" -m nimbus run "$@"\n' "$PY" > "$WORK/nimbus-run-python"
    chmod +x "$WORK/nimbus-run-python"
    ARGS+=(--python "$WORK/nimbus-run-python")
fi
if [ "${FAST:-0}" = 1 ]; then
    # Public tests that pass today and cover the main API; each -k is a substring of "Class.test".
    TAG=fast
    ARGS+=(--category public)
    for k in \
        WithProcessesTestProcess WithProcessesTestSubclassingProcess WithProcessesTestQueue \
        WithProcessesTestLock WithProcessesTestSemaphore WithProcessesTestPoll \
        WithProcessesTestLogging WithProcessesTestPoolWorkerLifetime \
        WithProcessesTestEvent.test_event WithProcessesTestValue.test_value \
        WithProcessesTestValue.test_rawvalue WithProcessesTestArray.test_array \
        WithProcessesTestArray.test_rawarray WithProcessesTestSharedCTypes.test_s \
        WithProcessesTestConnection.test_sendbytes WithProcessesTestConnection.test_duplex_false \
        WithProcessesTestConnection.test_spawn_close \
        WithProcessesTestPool.test_apply WithProcessesTestPool.test_async \
        WithProcessesTestPool.test_map_async WithProcessesTestPool.test_starmap \
        WithProcessesTestPool.test_imap WithProcessesTestPool.test_terminate \
        WithProcessesTestPool.test_wrapped_exception \
        WithManagerTestContainers WithManagerTestQueue WithManagerTestLock \
        WithManagerTestEvent WithManagerTestCondition \
        TestSyncManagerTypes TestInitializers TestSimpleQueue.test_close \
        TestStartMethod.test_get_all TestStartMethod.test_nested_startmethod \
        TestWait.test_neg_timeout
    do ARGS+=(-k "$k"); done
fi

cd "$WORK"
set +e
# SIGINT must not be ignored in the test processes: when this script runs in the background
# (cmd &, nohup, CI), the shell gives its children SIGINT=SIG_IGN, and _TestCondition.test_wait_result
# (which SIGINTs the parent) then hangs until the per-test timeout. Reset it before exec.
PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c \
    'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])' \
    run_suite.py "$CANDIDATE" \
    --flavours "$FLAVOURS" --baseline "$BASELINE" --tag "$TAG" --timeout "$TIMEOUT" \
    --budget "$BUDGET" --results-dir "$OUT" --show-failures 3 "${ARGS[@]}" "$@" > "$WORK/run.log" 2>&1
rc=$?
set -e

JSON="$OUT/${CANDIDATE//./_}_$TAG.json"
if [ ! -f "$JSON" ]; then
    tail -40 "$WORK/run.log"
    echo "run_suite.py failed (rc=$rc); log: $WORK/run.log" >&2
    exit 2
fi
status=0
"$PY" - "$JSON" "${FAST:-0}" <<'PY' || status=$?
import json, sys
d = json.load(open(sys.argv[1]))
fast = sys.argv[2] == '1'
t = d.get('transparency', {})
print(f"{d.get('module', 'nimbus.multiprocessing')} vs stdlib 3.11.7 baseline: {d['elapsed_s']:.0f} s, "
      f"flavours {','.join(d['flavours'])}, timeout {d['per_test_timeout_s']:.0f} s")
for cat in ('public', 'local', 'internal', 'all'):
    v = t.get(cat)
    if v and v['baseline_passing']:
        print(f"  {cat:9} {v['passing_here']:4d}/{v['baseline_passing']:<4d} = {v['score']:.4f}"
              f"   class-macro {v['class_macro_score']:.4f}")
tot = d['totals']['all']
print(f"  tests: {tot['tests']}  pass {tot['passed']}  fail {tot['failed']}  err {tot['errors']}"
      f"  timeout {tot['timeouts']}  skip {tot['skipped']}  not run {tot['not_run']}")
print(f"  flaky: {d.get('flaky') or []}")
print(f"  missing_names_stubbed: {d.get('missing_names_stubbed')}")
for cat in ('public', 'local', 'internal'):
    lost = t.get(cat, {}).get('lost', [])
    if lost:
        print(f"  lost {cat} ({len(lost)}): " + ' '.join(lost))
print(f"PUBLIC_SCORE {t.get('public', {}).get('score')}")
bad = tot['failed'] + tot['errors'] + tot['timeouts'] + tot['not_run']
sys.exit(1 if fast and bad else 0)
PY
echo "log: $WORK/run.log   json: $JSON"
exit $status
