#!/usr/bin/env bash
# Creates a Cloud TPU VM or pod slice with `gcloud compute tpus tpu-vm create`.
set -euo pipefail
XD_SCRIPT=create.sh
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<'USAGE'
Usage: create.sh --name NAME --zone ZONE --accelerator-type TYPE --version VERSION
                 [--project PROJECT] [--spot] [--dry-run]

Creates a Cloud TPU VM (one host, e.g. v4-8) or a pod slice (several hosts,
e.g. v5litepod-16 = 4 hosts x 4 chips).

  --name NAME               the TPU's name (lower-case letters, digits, '-')
  --zone ZONE               e.g. us-central2-b (v4), us-west4-a (v5e)
  --accelerator-type TYPE   e.g. v4-8, v5litepod-16, v6e-8
  --version VERSION         the TPU runtime (software) version, e.g.
                            tpu-ubuntu2204-base (v4), v2-alpha-tpuv5-lite (v5e)
  --project PROJECT         the Google Cloud project (default: gcloud's)
  --spot                    create a Spot TPU (cheaper, may be preempted)
  --dry-run                 print the gcloud command instead of running it
  -h, --help                show this help
USAGE
}

accelerator=""
version=""
spot=0
while [[ $# -gt 0 ]]; do
  xd_parse_common "$@"
  if [[ "$XD_USED" -gt 0 ]]; then
    shift "$XD_USED"
    continue
  fi
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --accelerator-type) accelerator=$(xd_value "$@"); shift 2 ;;
    --accelerator-type=*) accelerator=${1#*=}; shift ;;
    --version) version=$(xd_value "$@"); shift 2 ;;
    --version=*) version=${1#*=}; shift ;;
    --spot) spot=1; shift ;;
    *) xd_unknown "$1" ;;
  esac
done

xd_require_name_zone
[[ -n "$accelerator" ]] || xd_die "--accelerator-type is required (e.g. --accelerator-type v4-8)"
[[ "$accelerator" =~ ^(v[0-9]+[a-z]*|tpu[0-9]+[a-z]*)-[0-9]+$ ]] ||
  xd_die "--accelerator-type '$accelerator' is not a TPU type like v4-8 or v5litepod-16"
[[ -n "$version" ]] || xd_die "--version is required (the TPU runtime version, e.g. --version tpu-ubuntu2204-base)"

xd_location_flags
command=(gcloud compute tpus tpu-vm create "$XD_NAME" "${XD_FLAGS[@]}"
  "--accelerator-type=$accelerator" "--version=$version")
if [[ "$spot" == 1 ]]; then
  command+=(--spot)
fi
xd_run "${command[@]}"
