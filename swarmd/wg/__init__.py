"""WireGuard mesh: keys, overlay addresses, backends (kernel netlink, wireguard-go) and the reconciler."""
