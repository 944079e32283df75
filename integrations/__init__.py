"""Engine integrations: each turns one engine family's wire formats into kvplug events."""
