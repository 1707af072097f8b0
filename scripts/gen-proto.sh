#!/usr/bin/env bash
# Regenerates src/gen from proto/ (the one place generated protobuf code comes from).
# With --check, generates into a temporary folder and fails when src/gen differs.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/node_modules/.bin:$PATH"
if [ "${1:-}" = "--check" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  buf generate --output "$tmp"
  if ! diff -r "$tmp/src/gen" src/gen >/dev/null; then
    echo "src/gen is stale: run 'npm run gen' and commit the result" >&2
    diff -r "$tmp/src/gen" src/gen | head -20 >&2
    exit 1
  fi
  echo "src/gen is up to date"
else
  rm -rf src/gen
  buf generate
fi
