"""The API-server side: the daemon's own API client, node state and annotations, labels,
pod specs and the pod watch.

Three clients reach the API server, each on the library that suits who runs it:

* :mod:`gpushare.kube.stdlibclient` (``ApiClient``, ``http.client`` + ``ssl``): everything
  that runs in the cluster, so the daemon (through :mod:`gpushare.kube.apilink`, its
  background link that publishes node state and watches pods), the DRA driver's
  ResourceSlices and claims, the scheduler extender's pod watch, the benchmark. It is
  lean: the ``kubernetes`` package would cost the daemon about 38 MiB and a second of
  start for a handful of calls (a test checks that the daemon never imports it).
* :mod:`gpushare.kube.kubectlapi` (``Cluster``, the ``kubernetes`` package's
  ``ApiClient``): ``kubectl gpushare`` run by a person, whose kubeconfig may use any
  credential (exec plugins, auth providers) that only the ``kubernetes`` package
  handles; without that package (the single-file plugin) it falls back to
  :mod:`gpushare.kube.stdlibclient`.
* :mod:`gpushare.extender.bindingclient` (``BindingClient``, ``aiohttp``): the extender's
  one write, the pod's Binding, awaited on the extender's own aiohttp event loop (the
  ``kubernetes`` client also raises on the server's 201 answer to a Binding).

The test double of the API server is :mod:`gpushare.sim.apidouble`.
"""
