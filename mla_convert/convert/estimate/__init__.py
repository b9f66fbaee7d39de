"""Memory, disk and time estimates of a conversion before any work (inspect)."""
