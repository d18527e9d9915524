package k8s

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"

	"github.com/mgpu-dev/mgpu/test/e2e"
)

// Version is the Kubernetes release test/k8s/deps.sh builds.
const Version = "v1.37.2"

// Binaries are the programs a cluster runs.
type Binaries struct {
	APIServer, ControllerManager, Scheduler, Kubelet string
	Etcd                                             string
	Containerd                                       string // directory of containerd, ctr and containerd-shim-runc-v2
	CNI                                              string // directory of the CNI plugins bridge, host-local and loopback
}

// FindBinaries looks for the cluster's programs:
//   - the Kubernetes commands in $MGPU_K8S_BIN, else
//     $MGPU_K8S_CACHE/<Version>/bin (default /var/cache/mgpu-k8s), where
//     test/k8s/deps.sh builds them;
//   - etcd in $MGPU_ETCD, else PATH (Debian's etcd-server);
//   - containerd as e2e.ContainerdBinaries finds it (test/e2e/deps.sh);
//   - the CNI plugins in $MGPU_CNI_BIN, else /usr/lib/cni (Debian's
//     containernetworking-plugins), else /opt/cni/bin.
func FindBinaries() (Binaries, error) {
	var b Binaries
	var errs []error
	k8sBin := os.Getenv("MGPU_K8S_BIN")
	if k8sBin == "" {
		cache := os.Getenv("MGPU_K8S_CACHE")
		if cache == "" {
			cache = "/var/cache/mgpu-k8s"
		}
		k8sBin = filepath.Join(cache, Version, "bin")
	}
	for _, c := range []struct {
		dst  *string
		name string
	}{{&b.APIServer, "kube-apiserver"}, {&b.ControllerManager, "kube-controller-manager"},
		{&b.Scheduler, "kube-scheduler"}, {&b.Kubelet, "kubelet"}} {
		*c.dst = filepath.Join(k8sBin, c.name)
		if !executable(*c.dst) {
			errs = append(errs, fmt.Errorf("%s not found in %s", c.name, k8sBin))
		}
	}
	b.Etcd = os.Getenv("MGPU_ETCD")
	if b.Etcd == "" {
		if p, err := exec.LookPath("etcd"); err == nil {
			b.Etcd = p
		}
	}
	if !executable(b.Etcd) {
		errs = append(errs, errors.New("etcd not found (Debian's etcd-server)"))
	}
	var err error
	if b.Containerd, err = e2e.ContainerdBinaries(); err != nil {
		errs = append(errs, err)
	}
	cniDirs := []string{"/usr/lib/cni", "/opt/cni/bin"}
	if v := os.Getenv("MGPU_CNI_BIN"); v != "" {
		cniDirs = []string{v}
	}
	for _, d := range cniDirs {
		if executable(filepath.Join(d, "bridge")) && executable(filepath.Join(d, "host-local")) && executable(filepath.Join(d, "loopback")) {
			b.CNI = d
			break
		}
	}
	if b.CNI == "" {
		errs = append(errs, fmt.Errorf("CNI plugins bridge, host-local and loopback not found in %v (Debian's containernetworking-plugins)", cniDirs))
	}
	return b, errors.Join(errs...)
}

func executable(path string) bool {
	st, err := os.Stat(path)
	return err == nil && !st.IsDir() && st.Mode()&0o111 != 0
}
