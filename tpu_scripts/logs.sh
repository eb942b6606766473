#!/usr/bin/env bash
# Fetches the logs written by run.sh from every worker of a TPU VM / slice.
set -euo pipefail
XD_SCRIPT=logs.sh
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<'USAGE'
Usage: logs.sh --name NAME --zone ZONE [--workers N] [--project PROJECT]
               [--log-dir DIR] [--dest DIR] [--dry-run]

Copies LOG_DIR from each worker (gcloud ... scp --worker=I, one worker at a
time) into DEST/worker-I/ on this machine.

  --name NAME          the TPU's name
  --zone ZONE          its zone, e.g. us-central2-b
  --workers N          the number of workers (hosts) of the slice (default 1;
                       v4-8: 1, v4-32: 4, v5litepod-16: 4)
  --project PROJECT    the Google Cloud project (default: gcloud's)
  --log-dir DIR        the log directory on the workers (default: xladist-logs)
  --dest DIR           where to put the logs here (default: tpu-logs/NAME)
  --dry-run            print the commands instead of running them
  -h, --help           show this help
USAGE
}

workers=1
log_dir="$XD_DEFAULT_LOG_DIR"
dest=""
while [[ $# -gt 0 ]]; do
  xd_parse_common "$@"
  if [[ "$XD_USED" -gt 0 ]]; then
    shift "$XD_USED"
    continue
  fi
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --workers) workers=$(xd_value "$@"); shift 2 ;;
    --workers=*) workers=${1#*=}; shift ;;
    --log-dir) log_dir=$(xd_value "$@"); shift 2 ;;
    --log-dir=*) log_dir=${1#*=}; shift ;;
    --dest) dest=$(xd_value "$@"); shift 2 ;;
    --dest=*) dest=${1#*=}; shift ;;
    *) xd_unknown "$1" ;;
  esac
done

xd_require_name_zone
xd_require_int --workers "$workers" 1
[[ -n "$log_dir" ]] || xd_die "--log-dir must not be empty"
dest=${dest:-tpu-logs/$XD_NAME}

xd_location_flags
for ((worker = 0; worker < workers; worker++)); do
  xd_run mkdir -p "$dest/worker-$worker"
  xd_run gcloud compute tpus tpu-vm scp --recurse "$XD_NAME:$log_dir" "$dest/worker-$worker" \
    "${XD_FLAGS[@]}" "--worker=$worker"
done
