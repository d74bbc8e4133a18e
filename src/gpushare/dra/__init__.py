"""The DRA driver: a second front door (resource.k8s.io/v1, consumable capacity)."""
