"""Where workers come from besides the command line and the admin API: etcd leases
(:mod:`kvplug.discovery.etcd`) and Kubernetes EndpointSlices (:mod:`kvplug.discovery.kubernetes`),
both mirrored into the frontend's fleet by :class:`kvplug.discovery.mirror.FleetMirror`."""
