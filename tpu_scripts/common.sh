# shellcheck shell=bash
# Helpers shared by the tpu_scripts/*.sh scripts; sourced, not run.
#
# Every script parses its options with xd_parse_common / its own case arms,
# validates them with the xd_require_* helpers, and runs gcloud through xd_run,
# which under --dry-run prints the command (each word quoted with printf %q,
# one command per line) instead of running it.

XD_SCRIPT=${XD_SCRIPT:-$(basename "$0")}
XD_DRY_RUN=0
XD_NAME=""
XD_ZONE=""
XD_PROJECT=""

# Defaults shared by setup.sh, run.sh and logs.sh (paths on the TPU VM workers,
# relative to the remote home directory).
# shellcheck disable=SC2034  # used by the scripts that source this file
XD_DEFAULT_VENV="xladist-venv"
# shellcheck disable=SC2034
XD_DEFAULT_LOG_DIR="xladist-logs"

xd_die() {
  printf '%s: error: %s\n' "$XD_SCRIPT" "$*" >&2
  printf 'Run %s --help for the options.\n' "$XD_SCRIPT" >&2
  exit 2
}

# xd_quote WORD...: the words, each quoted with printf %q, joined by spaces.
xd_quote() {
  local out="" word
  for word in "$@"; do
    out+="${out:+ }$(printf '%q' "$word")"
  done
  printf '%s' "$out"
}

# xd_run CMD ARG...: runs the command, or prints it under --dry-run.
xd_run() {
  if [[ "$XD_DRY_RUN" == 1 ]]; then
    printf '%s\n' "$(xd_quote "$@")"
  else
    "$@"
  fi
}

# xd_value "$@": the value of option $1 given as "--opt VALUE" (the caller then
# shifts 2); fails when it is missing. A value starting with "--" must be given
# as --opt=VALUE.
xd_value() {
  if [[ $# -lt 2 || "$2" == --* ]]; then
    xd_die "$1 needs a value"
  fi
  printf '%s' "$2"
}

# shellcheck disable=SC2034  # XD_USED is read by the scripts that source this file
# xd_parse_common "$@": handles --name/--zone/--project/--dry-run (with a
# separate or '='-joined value); returns the number of words used (0 if the
# first word is not a common option) in XD_USED.
xd_parse_common() {
  XD_USED=0
  case "$1" in
    --name) XD_NAME=$(xd_value "$@") || exit 2; XD_USED=2 ;;
    --name=*) XD_NAME=${1#*=}; XD_USED=1 ;;
    --zone) XD_ZONE=$(xd_value "$@") || exit 2; XD_USED=2 ;;
    --zone=*) XD_ZONE=${1#*=}; XD_USED=1 ;;
    --project) XD_PROJECT=$(xd_value "$@") || exit 2; XD_USED=2 ;;
    --project=*) XD_PROJECT=${1#*=}; XD_USED=1 ;;
    --dry-run) XD_DRY_RUN=1; XD_USED=1 ;;
  esac
}

xd_unknown() {
  xd_die "unknown argument '$1'"
}

# xd_require_name_zone: --name and --zone are set and well formed.
xd_require_name_zone() {
  [[ -n "$XD_NAME" ]] || xd_die "--name is required (the TPU VM's name, e.g. --name my-tpu)"
  [[ "$XD_NAME" =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] ||
    xd_die "--name '$XD_NAME' is not a valid TPU name (lower-case letters, digits and '-', starting with a letter)"
  [[ -n "$XD_ZONE" ]] || xd_die "--zone is required (e.g. --zone us-central2-b)"
  [[ "$XD_ZONE" =~ ^[a-z]+-[a-z]+[0-9]+-[a-z]$ ]] ||
    xd_die "--zone '$XD_ZONE' is not a zone name like us-central2-b"
  if [[ -n "$XD_PROJECT" && ! "$XD_PROJECT" =~ ^[a-z][-a-z0-9:.]*[a-z0-9]$ ]]; then
    xd_die "--project '$XD_PROJECT' is not a project id like my-project"
  fi
}

# xd_location_flags: sets XD_FLAGS to the --zone (and --project) flags of gcloud.
xd_location_flags() {
  XD_FLAGS=("--zone=$XD_ZONE")
  if [[ -n "$XD_PROJECT" ]]; then
    XD_FLAGS+=("--project=$XD_PROJECT")
  fi
}

# xd_require_int OPTION VALUE [MINIMUM]
xd_require_int() {
  [[ "$2" =~ ^[0-9]+$ && "$2" -ge "${3:-0}" ]] ||
    xd_die "$1 '$2' is not an integer >= ${3:-0}"
}
