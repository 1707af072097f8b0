#!/usr/bin/env bash
# Prints the path of a Go that can build helm and Kubernetes: the machine's when it is 1.21 or
# newer (it fetches the toolchain a module asks for itself, GOTOOLCHAIN=auto), else a toolchain
# from the Go module proxy unpacked into .tools/go once. Progress goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."

GO_FALLBACK=1.26.8 # the toolchain fetched when the machine has no usable Go
TOOLS=$PWD/.tools

go_ok() { # a go that can fetch newer toolchains itself (1.21+)
  "$1" version 2>/dev/null | grep -qE 'go1\.(2[1-9]|[3-9][0-9])'
}
if command -v go >/dev/null 2>&1 && go_ok go; then
  command -v go
  exit 0
fi
if [ -x "$TOOLS/go/bin/go" ] && go_ok "$TOOLS/go/bin/go"; then
  echo "$TOOLS/go/bin/go"
  exit 0
fi
echo "kvxfer setup (go): no Go 1.21+ here; fetching go$GO_FALLBACK from the Go module proxy" >&2
python3 - "$TOOLS" "$GO_FALLBACK" <<'PY' || { echo "kvxfer setup (go): could not fetch a Go toolchain from proxy.golang.org" >&2; exit 1; }
import io, os, shutil, stat, sys, urllib.request, zipfile
tools, version = sys.argv[1], sys.argv[2]
url = f"https://proxy.golang.org/golang.org/toolchain/@v/v0.0.1-go{version}.linux-amd64.zip"
with urllib.request.urlopen(url, timeout=300) as r:
    data = r.read()
prefix = f"golang.org/toolchain@v0.0.1-go{version}.linux-amd64/"
dest = os.path.join(tools, "go")
shutil.rmtree(dest, ignore_errors=True)
with zipfile.ZipFile(io.BytesIO(data)) as z:
    for info in z.infolist():
        if not info.filename.startswith(prefix) or info.is_dir():
            continue
        path = os.path.join(dest, info.filename[len(prefix):])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with z.open(info) as src, open(path, "wb") as out:
            shutil.copyfileobj(src, out)
        mode = info.external_attr >> 16
        if mode & 0o111:
            os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
PY
echo "$TOOLS/go/bin/go"
