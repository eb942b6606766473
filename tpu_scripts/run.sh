#!/usr/bin/env bash
# Runs one command on every worker of a TPU VM / slice, in the xladist venv.
set -euo pipefail
XD_SCRIPT=run.sh
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<'USAGE'
Usage: run.sh --name NAME --zone ZONE [--project PROJECT] [--copy PATH]...
              [--env KEY=VALUE]... [--venv DIR] [--log-dir DIR] [--dry-run]
              -- COMMAND [ARG...]

Starts COMMAND at the same time on every worker (gcloud ... ssh --worker=all),
in the home directory, with the venv made by setup.sh activated and
PJRT_DEVICE=TPU set (xladist runs one process per host). Its output goes to
the terminal and to LOG_DIR/<worker hostname>.log on each worker (fetch them
with logs.sh). The command returns when every worker has finished.

  --name NAME          the TPU's name
  --zone ZONE          its zone, e.g. us-central2-b
  --project PROJECT    the Google Cloud project (default: gcloud's)
  --copy PATH          copy a file or directory to every worker's home
                       directory first (repeatable), e.g. --copy examples
  --env KEY=VALUE      another environment variable for COMMAND (repeatable)
  --venv DIR           the venv on the workers (default: xladist-venv)
  --log-dir DIR        the log directory on the workers (default: xladist-logs)
  --dry-run            print the gcloud commands instead of running them
  -h, --help           show this help

Example:
  run.sh --name my-tpu --zone us-central2-b --copy examples -- python examples/train_digits.py
USAGE
}

venv="$XD_DEFAULT_VENV"
log_dir="$XD_DEFAULT_LOG_DIR"
copies=()
envs=(PJRT_DEVICE=TPU)
user_command=()
while [[ $# -gt 0 ]]; do
  xd_parse_common "$@"
  if [[ "$XD_USED" -gt 0 ]]; then
    shift "$XD_USED"
    continue
  fi
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --copy) copies+=("$(xd_value "$@")"); shift 2 ;;
    --copy=*) copies+=("${1#*=}"); shift ;;
    --env) envs+=("$(xd_value "$@")"); shift 2 ;;
    --env=*) envs+=("${1#*=}"); shift ;;
    --venv) venv=$(xd_value "$@"); shift 2 ;;
    --venv=*) venv=${1#*=}; shift ;;
    --log-dir) log_dir=$(xd_value "$@"); shift 2 ;;
    --log-dir=*) log_dir=${1#*=}; shift ;;
    --) shift; user_command=("$@"); break ;;
    *) xd_unknown "$1" ;;
  esac
done

xd_require_name_zone
[[ "${#user_command[@]}" -gt 0 ]] ||
  xd_die "no command to run: put it after '--', e.g. -- python examples/train_digits.py"
for assignment in "${envs[@]}"; do
  [[ "$assignment" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] ||
    xd_die "--env '$assignment' is not KEY=VALUE (e.g. --env XLA_FLAGS=--xla_dump_to=/tmp/x)"
done
[[ -n "$venv" ]] || xd_die "--venv must not be empty"
[[ -n "$log_dir" ]] || xd_die "--log-dir must not be empty"

xd_location_flags
for path in "${copies[@]+"${copies[@]}"}"; do
  if [[ "$XD_DRY_RUN" != 1 && ! -e "$path" ]]; then
    xd_die "--copy '$path' does not exist"
  fi
  # --recurse copies files and directories alike.
  xd_run gcloud compute tpus tpu-vm scp --recurse "$path" "$XD_NAME:." \
    "${XD_FLAGS[@]}" --worker=all
done

log="$(xd_quote "$log_dir")/\"\$(hostname)\".log"
remote="set -eo pipefail; source $(xd_quote "$venv")/bin/activate; "
remote+="mkdir -p $(xd_quote "$log_dir"); export $(xd_quote "${envs[@]}"); "
remote+="$(xd_quote "${user_command[@]}") 2>&1 | tee $log"
xd_run gcloud compute tpus tpu-vm ssh "$XD_NAME" "${XD_FLAGS[@]}" --worker=all \
  "--command=$remote"
