# Sourced by the setup scripts. `apt_install_missing WHY PACKAGE...`: apt-get installs those of the packages
# that are not installed yet (none: no apt-get at all, so re-running a setup script stays a no-op). Needs root.
apt_install_missing() {
    local why=$1
    shift
    local missing=() package
    for package in "$@"; do
        dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "installing ${missing[*]} (apt-get${why:+, $why})" >&2
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
}
