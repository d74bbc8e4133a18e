"""The device-plugin front door (kubelet v1beta1): the gRPC servers, registration and
re-registration, binding, the PodResources client and the usage refresher."""
