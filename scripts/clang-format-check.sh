#!/usr/bin/env bash
# Checks (or with --fix, rewrites) the C++ formatting of native/src.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v clang-format >/dev/null 2>&1; then
  echo "clang-format is not installed: run scripts/setup.sh (or apt-get install clang-format)" >&2
  exit 1
fi
files=$(find native/src -name '*.cc' -o -name '*.h')
if [ "${1:-}" = "--fix" ]; then
  clang-format -i $files
else
  clang-format --dry-run --Werror $files
fi
