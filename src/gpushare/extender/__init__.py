"""The kube-scheduler extender: one card per GPU container, decided before binding."""
