#!/usr/bin/env bash
# CPython 3.11's own multiprocessing test suite against nimbus.multiprocessing,
# scored against the stdlib baseline (see README.md next to this file).
#
#   bench/transparency/run.sh                      # full score run (~25-30 min on 2 cores)
#   bench/transparency/run.sh --budget 1500        # stop starting new tests after 25 min
#   FAST=1 bench/transparency/run.sh               # the fast subset (< 2 min), see README.md
#   bench/transparency/run.sh -k TestSimpleQueue   # any extra run_suite.py option is passed on
#
# Env: HARNESS (default <repo>/../shared/transparency), BASELINE (stdlib baseline JSON),
#      FLAVOURS (processes,manager,misc), TIMEOUT (60 s per test), OUT (where the JSON
#      results are kept; default a temp dir that is printed), KEEP=1 keeps the temp dir.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HARNESS="${HARNESS:-$REPO/../shared/transparency}"
BASELINE="${BASELINE:-$HARNESS/baseline/stdlib-3.11.7.json}"
FLAVOURS="${FLAVOURS:-processes,manager,misc}"
TIMEOUT="${TIMEOUT:-60}"
PY="$REPO/.venv/bin/python"

[ -x "$PY" ] || { echo "no venv python at $PY" >&2; exit 2; }
[ -f "$HARNESS/run_suite.py" ] || { echo "no harness at $HARNESS" >&2; exit 2; }

# The harness writes gen/ and results/ next to itself and is read-only where it is: copy it.
WORK="$(mktemp -d /tmp/nimbus-transparency.XXXXXX)"
cp -r "$HARNESS/." "$WORK/"
chmod -R u+w "$WORK"
OUT="${OUT:-$WORK/results}"
mkdir -p "$OUT"

EXTRA=()
TAG=score
if [ "${FAST:-0}" = 1 ]; then
    # Fast subset: classes that pass fully today and cover the main API (see README.md).
    TAG=fast
    for k in \
        WithProcessesTestArray.test_array WithProcessesTestArray.test_rawarray \
        WithProcessesTestValue.test_rawvalue \
        WithProcessesTestLock WithProcessesTestEvent WithProcessesTestCondition \
        WithProcessesTestSharedCTypes WithProcessesTestListener \
        WithProcessesTestQueue.test_put WithProcessesTestQueue.test_get \
        WithProcessesTestQueue.test_fork WithProcessesTestQueue.test_task_done \
        WithProcessesTestPool.test_map WithProcessesTestPool.test_apply \
        WithProcessesTestPool.test_imap WithProcessesTestPool.test_starmap \
        WithManagerTestContainers WithManagerTestEvent WithManagerTestLock \
        TestSimpleQueue.test_empty TestWait.test_wait \
        TestStartMethod.test_context TestStartMethod.test_get_all
    do EXTRA+=(-k "$k"); done
fi

cd "$WORK"
set +e
PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}" "$PY" run_suite.py nimbus.multiprocessing \
    --flavours "$FLAVOURS" --baseline "$BASELINE" --tag "$TAG" --timeout "$TIMEOUT" \
    --results-dir "$OUT" --show-failures 0 --quiet "${EXTRA[@]}" "$@" > "$WORK/run.log" 2>&1
rc=$?
set -e

JSON="$OUT/nimbus.multiprocessing_$TAG.json"
[ -f "$JSON" ] || JSON="$(ls -t "$OUT"/*.json 2>/dev/null | head -1 || true)"
if [ -z "$JSON" ] || [ ! -f "$JSON" ]; then
    tail -40 "$WORK/run.log"; echo "run_suite.py failed (rc=$rc); log: $WORK/run.log" >&2; exit 1
fi
"$PY" - "$JSON" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
t = d.get('transparency', {})
print(f"nimbus.multiprocessing vs stdlib 3.11.7  ({d['elapsed_s']:.0f} s, "
      f"flavours {','.join(d['flavours'])}, timeout {d['per_test_timeout_s']:.0f} s)")
for cat in ('public', 'local', 'internal', 'all'):
    v = t.get(cat)
    if v and v['baseline_passing']:
        print(f"  {cat:9} {v['passing_here']:4d}/{v['baseline_passing']:<4d} = {v['score']:.4f}"
              f"   class-macro {v['class_macro_score']:.4f}")
tot = d['totals']['all']
print(f"  all tests: {tot['tests']} run, {tot['passed']} pass, {tot['failed']} fail, "
      f"{tot['errors']} err, {tot['timeouts']} timeout, {tot['skipped']} skip, {tot['not_run']} not run")
print(f"  flaky: {len(d.get('flaky', []))}  missing_names_stubbed: {d.get('missing_names_stubbed')}")
lost = t.get('public', {}).get('lost', [])
if lost:
    print(f"  lost public tests ({len(lost)}):")
    for name in lost:
        print('    ' + name)
print(f"PUBLIC_SCORE {t.get('public', {}).get('score')}")
PY
echo "log: $WORK/run.log   json: $JSON"
[ "${KEEP:-1}" = 1 ] || rm -rf "$WORK"
