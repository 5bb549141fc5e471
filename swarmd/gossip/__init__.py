"""libp2p host, signed capacity records, membership view, failure detection."""
