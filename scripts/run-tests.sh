#!/usr/bin/env bash
# The suite as `make test` runs it: most tests on KVXFERD_TEST_WORKERS pytest-xdist workers
# (default 2), then the tests marked host_global alone. Most of a test's time is spent
# waiting on daemons (timeouts, heartbeats, SIGSTOPped peers): serial, the suite kept 0.86
# of the two cores busy on average, for 23 minutes; on two workers it takes 13.
#
# Units (`--dist loadfile`, widened in tests/conftest.py): one worker runs each test file
# whole (its module fixtures set up once), and tests/cluster and tests/container whole.
# host_global tests reserve hugetlb pages or change shmem THP for the host, which daemons
# running beside them would take.
#
# Exit status: the first failure's; pytest's 5 ("no tests collected") from either part is a
# failure too. Both parts run even when the first fails, so one CI run reports everything.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${VENV:-.venv}/bin/python"
WORKERS="${KVXFERD_TEST_WORKERS:-2}"
common=(-q -p no:cacheprovider)

if [ "$WORKERS" = 0 ]; then
  parallel=()
else
  parallel=(-n "$WORKERS" --dist loadfile)
fi
"$PY" -m pytest "${common[@]}" "${parallel[@]}" -m "not host_global" --durations=30 "$@"
rc=$?
"$PY" -m pytest "${common[@]}" -m host_global --durations=5 "$@"
rc2=$?
for code in "$rc" "$rc2"; do
  if [ "$code" -ne 0 ]; then
    [ "$code" -eq 5 ] && echo "run-tests: a part collected no tests" >&2
    exit "$code"
  fi
done
exit 0
