// Package k8s starts a real single-node Kubernetes cluster for tests and
// tears it down again: StartCluster runs, each in a private directory and
// all on 127.0.0.1 with free ports,
//
//   - etcd (Debian's etcd-server);
//   - kube-apiserver (Node,RBAC authorization, the default admission
//     plugins plus NodeRestriction, certificates and the service-account
//     key made in Go at start);
//   - kube-controller-manager and kube-scheduler (no leader election, no
//     serving port);
//   - containerd 2.x with its CRI (CDI spec directories from Options,
//     sandbox image PauseImage built from ./pause and imported, pod
//     network namespaces under its state directory, NRI off);
//   - the kubelet, with --root-dir KubeletRootDir (the device-plugin
//     directory is fixed beneath it), cgroupfs, node labels from Options.
//
// Its node address is 127.0.0.1: a kubelet refuses a loopback --node-ip,
// so it runs with --cloud-provider=external and StartCluster plays the
// cloud provider (sets the InternalIP, removes the uninitialized taint);
// the apiserver reaches the kubelet there for pods/log, exec and
// port-forward. Pods get an address on the bridge PodBridge (PodCIDR,
// host-local IPAM): the CRI plugin wants an eth0 with an address, so
// loopback alone does not do; the bridge has no address on the host, no
// gateway and no masquerade. Nothing routes to Services (no kube-proxy,
// no DNS). An admission webhook is called by URL (https://127.0.0.1:port).
//
// Images are never pulled: WriteImage and BuildImageFromDir make OCI
// image tarballs from directories, ImportImage imports them into the CRI
// (ctr -n k8s.io images import); pods use imagePullPolicy Never or
// IfNotPresent.
//
// RenderChart renders charts/mgpu with helm ($CACHE_DIR/bin/helm, which
// make deps installs, else helm on PATH); TestChartInstall installs it on
// the cluster with helm, the mgpu image built from the build and imported.
//
// Clusters of concurrent test binaries take turns (/run/mgpu-k8s.lock).
// Teardown (t.Cleanup, also after a failure or panic) deletes the pods,
// stops everything, kills what containers are left, unmounts, removes the
// pod bridge, the kubepods cgroups, KubeletRootDir and the other host
// paths it made, and puts back the sysctls the kubelet changed; when the
// test failed it logs the end of every component's log first.
//
// The binaries come from test/k8s/deps.sh (etcd, the Kubernetes commands,
// the CNI plugins) and test/e2e/deps.sh (containerd); without them, or
// without root, StartCluster skips the test. Environment:
//
//	MGPU_K8S_BIN     directory of kube-apiserver, kube-controller-manager,
//	                 kube-scheduler and kubelet (default
//	                 $MGPU_K8S_CACHE/<Version>/bin)
//	MGPU_K8S_CACHE   test/k8s/deps.sh's cache (default /var/cache/mgpu-k8s)
//	MGPU_ETCD        etcd (default: etcd on PATH)
//	MGPU_CNI_BIN     directory of the CNI plugins (default /usr/lib/cni,
//	                 else /opt/cni/bin)
//	MGPU_CONTAINERD, MGPU_E2E_CACHE  containerd, as for test/e2e
//	MGPU_BUILD       the build directory of `make build` (the smoke test's
//	                 workload image; default build/ at the repository root)
//	MGPU_K8S_KEEP    when set, the cluster's directory is kept
package k8s
