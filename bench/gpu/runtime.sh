# Sourced by run.sh (on the GPU machine) and prepare.sh --check (here): turns the staged carry into
# something that runs, outside the (possibly read-only) working tree.
#   kvxfer_runtime CARRY RUNTIME PYTHON
# makes RUNTIME/bin/node (decompressed), RUNTIME/app (package.json, native/, build/ and the
# bundled sidecar CLI with its node_modules: the addon's loader finds its root there), installs
# the carried pyzmq wheel into RUNTIME/site when PYTHON has no zmq, and exports PATH (node first),
# KVXFER_CLI, LD_LIBRARY_PATH (the carried UCX) and PYTHONPATH (carried protobuf, RUNTIME/site).
kvxfer_runtime() {
  local carry=$1 rt=$2 py=$3
  rm -rf "$rt"
  mkdir -p "$rt/bin" "$rt/app"
  xz -dc "$carry/node.xz" >"$rt/bin/node" || return 1
  chmod +x "$rt/bin/node"
  if [ "$(sha256sum "$rt/bin/node" | cut -d' ' -f1)" != "$(cat "$carry/node.sha256")" ]; then
    echo "runtime: node.xz does not decompress to what was packed" >&2
    return 1
  fi
  cp -r "$carry/package.json" "$carry/native" "$carry/build" "$rt/app/"
  tar -xJf "$carry/sidecar.tar.xz" -C "$rt/app" || return 1
  export PATH="$rt/bin:$PATH"
  export KVXFER_CLI="$rt/app/cli/main.js"
  export LD_LIBRARY_PATH="$carry/ucx/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # The driver's libraries (libcuda.so.1 for the addon, libnvidia-ml.so.1 for UCX's cuda module)
  # where a container mounts them outside the loader's cache.
  local d
  for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib; do
    [ -d "$d" ] && LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$d"
  done
  export PYTHONPATH="$carry/py${PYTHONPATH:+:$PYTHONPATH}"
  if ! "$py" -c 'import zmq' 2>/dev/null; then
    if ls "$carry"/whl/*.whl >/dev/null 2>&1; then
      "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$rt/site" "$carry"/whl/*.whl &&
        export PYTHONPATH="$rt/site:$PYTHONPATH"
    else
      echo "runtime: $py has no pyzmq and no wheel was carried: part (c) runs without sidecars" >&2
    fi
  fi
}
