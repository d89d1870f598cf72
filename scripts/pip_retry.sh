# Sourced by the setup scripts: `pip_retry PYTHON PIP_ARGS...` runs `PYTHON -m pip PIP_ARGS...`
# and, when it fails, runs it again, up to JETRL_PIP_ATTEMPTS times in all (default 3), waiting
# JETRL_PIP_RETRY_WAIT_S seconds (default 20) before the second attempt and twice as long before
# each later one. Why: the CUDA torch the vLLM 0.20/0.25 tiers need pulls ~3 GB of nvidia-* wheels
# from PyPI, and one CI run lost its environment to a 423 MB download that stopped at the same byte
# through all six of pip's own resume attempts ("error: incomplete-download"); a fresh request
# later is what such a stall needs. pip keeps what an attempt finished (`pip download -d` skips
# files already there; `pip install` installs nothing until every download is done), so a retry
# only repeats the part that failed. A failure that retrying cannot fix (a resolver conflict)
# costs the waits, then returns pip's exit status like a single run would.

pip_retry() {  # PYTHON PIP_ARGS...
  local py=$1
  shift
  local attempt=1 status=0
  local attempts=${JETRL_PIP_ATTEMPTS:-3} wait=${JETRL_PIP_RETRY_WAIT_S:-20}
  if ! [[ "$attempts" =~ ^[1-9][0-9]*$ && "$wait" =~ ^[0-9]+$ ]]; then
    echo "[pip_retry] JETRL_PIP_ATTEMPTS='$attempts' / JETRL_PIP_RETRY_WAIT_S='$wait':" \
         "set a whole number of attempts >= 1 and of seconds >= 0" >&2
    return 2
  fi
  while :; do
    status=0
    "$py" -m pip --disable-pip-version-check "$@" || status=$?
    [ "$status" -ne 0 ] || return 0
    if [ "$attempt" -ge "$attempts" ]; then
      echo "[pip_retry] pip $1 failed $attempt time(s) (last exit $status); giving up" >&2
      return "$status"
    fi
    echo "[pip_retry] pip $1 failed (exit $status), attempt $attempt of $attempts; again in $wait s" >&2
    sleep "$wait"
    attempt=$((attempt + 1))
    wait=$((wait * 2))
  done
}
