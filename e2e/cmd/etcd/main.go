// etcd is etcd's own server (go.etcd.io/etcd/server/v3, the version k8s.io/kubernetes pins),
// built from this module so that the e2e cluster needs nothing but Go modules.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
