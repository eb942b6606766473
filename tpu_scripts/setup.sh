#!/usr/bin/env bash
# Installs xladist in a virtual environment on every worker of a TPU VM / slice.
set -euo pipefail
XD_SCRIPT=setup.sh
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<'USAGE'
Usage: setup.sh --name NAME --zone ZONE --source SOURCE [--project PROJECT]
                [--extras EXTRAS] [--venv DIR] [--python PYTHON]
                [--pip-args=ARGS] [--dry-run]

On every worker (gcloud ... ssh --worker=all): creates a virtual environment
and installs "xladist[EXTRAS]" (torch, torch_xla and libtpu with the default
extras "tpu").

  --name NAME          the TPU's name
  --zone ZONE          its zone, e.g. us-central2-b
  --source SOURCE      where xladist comes from, either
                         a git URL (git+https://..., https://....git, git@...:...),
                           installed with pip's "xladist[EXTRAS] @ git+URL"; or
                         a local wheel or sdist (e.g. dist/xladist-0.1.0-py3-none-any.whl,
                           made with `python -m pip wheel --no-deps -w dist .`),
                           first copied to every worker's home directory
  --project PROJECT    the Google Cloud project (default: gcloud's)
  --extras EXTRAS      pip extras, comma-separated (default: tpu; the digits
                       example also needs dev: --extras tpu,dev)
  --venv DIR           the venv on the workers, relative to the home directory
                       (default: xladist-venv)
  --python PYTHON      the workers' Python that makes the venv (default: python3)
  --pip-args=ARGS      extra words for `pip install` (e.g. an index URL), given
                       with '=' and inserted as they are
  --dry-run            print the gcloud commands instead of running them
  -h, --help           show this help
USAGE
}

source_spec=""
extras="tpu"
venv="$XD_DEFAULT_VENV"
python="python3"
pip_args=""
while [[ $# -gt 0 ]]; do
  xd_parse_common "$@"
  if [[ "$XD_USED" -gt 0 ]]; then
    shift "$XD_USED"
    continue
  fi
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --source) source_spec=$(xd_value "$@"); shift 2 ;;
    --source=*) source_spec=${1#*=}; shift ;;
    --extras) extras=$(xd_value "$@"); shift 2 ;;
    --extras=*) extras=${1#*=}; shift ;;
    --venv) venv=$(xd_value "$@"); shift 2 ;;
    --venv=*) venv=${1#*=}; shift ;;
    --python) python=$(xd_value "$@"); shift 2 ;;
    --python=*) python=${1#*=}; shift ;;
    --pip-args=*) pip_args=${1#*=}; shift ;;
    --pip-args) xd_die "give --pip-args with '=': --pip-args='--index-url URL'" ;;
    *) xd_unknown "$1" ;;
  esac
done

xd_require_name_zone
[[ -n "$source_spec" ]] ||
  xd_die "--source is required: a git URL of xladist or a local wheel or sdist (dist/xladist-*.whl)"
[[ "$extras" =~ ^[A-Za-z0-9_-]+(,[A-Za-z0-9_-]+)*$ ]] ||
  xd_die "--extras '$extras' is not a comma-separated list of extras like tpu,dev"
[[ -n "$venv" ]] || xd_die "--venv must not be empty"

xd_location_flags
case "$source_spec" in
  git+* | *.git | *.git@* | git@*)
    url=$source_spec
    [[ "$url" == git+* ]] || url="git+$url"
    requirement="xladist[$extras] @ $url"
    ;;
  *.tar.gz | *.whl | *.zip)
    if [[ "$XD_DRY_RUN" != 1 && ! -f "$source_spec" ]]; then
      xd_die "--source '$source_spec' is not a file; build a wheel with: python -m pip wheel --no-deps -w dist ."
    fi
    archive=$(basename "$source_spec")
    requirement="./${archive}[${extras}]"
    xd_run gcloud compute tpus tpu-vm scp "$source_spec" "$XD_NAME:$archive" \
      "${XD_FLAGS[@]}" --worker=all
    ;;
  *)
    xd_die "--source '$source_spec' is neither a git URL (git+https://..., ....git) nor an sdist/wheel file (.tar.gz, .whl)"
    ;;
esac

pip="$(xd_quote "$venv")/bin/pip"
remote="set -euo pipefail; $(xd_quote "$python") -m venv $(xd_quote "$venv"); "
remote+="$pip install --upgrade pip; "
remote+="$pip install${pip_args:+ $pip_args} $(xd_quote "$requirement")"
xd_run gcloud compute tpus tpu-vm ssh "$XD_NAME" "${XD_FLAGS[@]}" --worker=all \
  "--command=$remote"
