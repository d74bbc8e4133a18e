"""The API-server side: the daemon's own API client, node state and annotations, labels,
pod specs and the pod watch."""
