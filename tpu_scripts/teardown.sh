#!/usr/bin/env bash
# Deletes a Cloud TPU VM or pod slice with `gcloud compute tpus tpu-vm delete`.
set -euo pipefail
XD_SCRIPT=teardown.sh
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<'USAGE'
Usage: teardown.sh --name NAME --zone ZONE [--project PROJECT] [--yes] [--dry-run]

Deletes the TPU (all its workers and their disks: fetch logs first with logs.sh).

  --name NAME         the TPU's name
  --zone ZONE         its zone, e.g. us-central2-b
  --project PROJECT   the Google Cloud project (default: gcloud's)
  --yes               do not ask for confirmation (gcloud --quiet)
  --dry-run           print the gcloud command instead of running it
  -h, --help          show this help
USAGE
}

yes=0
while [[ $# -gt 0 ]]; do
  xd_parse_common "$@"
  if [[ "$XD_USED" -gt 0 ]]; then
    shift "$XD_USED"
    continue
  fi
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --yes) yes=1; shift ;;
    *) xd_unknown "$1" ;;
  esac
done

xd_require_name_zone
xd_location_flags
command=(gcloud compute tpus tpu-vm delete "$XD_NAME" "${XD_FLAGS[@]}")
if [[ "$yes" == 1 ]]; then
  command+=(--quiet)
fi
xd_run "${command[@]}"
