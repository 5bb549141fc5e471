"""Services (issue 27): the registry as members read it, the controllers that keep replicas,
the host side that runs and announces them, and the gateway that routes requests to them."""
