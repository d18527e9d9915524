package k8s

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// criNamespace is the containerd namespace of the CRI plugin.
const criNamespace = "k8s.io"

// containerdConfig is containerd's config (version 3) for the kubelet:
// everything under dir, CRI with CDI from specDirs, the sandbox image
// pinned to PauseImage, CNI from cniConf with the plugins of cniBin,
// network namespaces under the state directory, streaming on 127.0.0.1,
// NRI off (its socket is host-wide), runc with cgroupfs (the default),
// oom_score_adj never below containerd's own, runc's state under dir.
func containerdConfig(dir, cniBin, cniConf string, specDirs []string) string {
	quoted := make([]string, len(specDirs))
	for i, d := range specDirs {
		quoted[i] = fmt.Sprintf("%q", d)
	}
	return fmt.Sprintf(`version = 3
root = %q
state = %q

[grpc]
  address = %q

[ttrpc]
  address = %q

[debug]
  address = %q

[metrics]
  address = ""

[plugins]
  [plugins."io.containerd.internal.v1.opt"]
    path = %q
  [plugins."io.containerd.nri.v1.nri"]
    disable = true
  [plugins."io.containerd.cri.v1.images"]
    snapshotter = "overlayfs"
    [plugins."io.containerd.cri.v1.images".pinned_images]
      sandbox = %q
  [plugins."io.containerd.cri.v1.runtime"]
    cdi_spec_dirs = [%s]
    netns_mounts_under_state_dir = true
    enable_unprivileged_ports = true
    enable_unprivileged_icmp = true
    # Lowering an oom_score_adj needs CAP_SYS_RESOURCE, which a CI container
    # may lack (runc then fails with "can't get final child's PID from pipe").
    restrict_oom_score_adj = true
    [plugins."io.containerd.cri.v1.runtime".containerd]
      default_runtime_name = "runc"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
          SystemdCgroup = false
          Root = %q
    [plugins."io.containerd.cri.v1.runtime".cni]
      bin_dirs = [%q]
      conf_dir = %q
      max_conf_num = 1
  [plugins."io.containerd.grpc.v1.cri"]
    disable_tcp_service = true
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
`, filepath.Join(dir, "root"), filepath.Join(dir, "state"),
		filepath.Join(dir, "containerd.sock"), filepath.Join(dir, "containerd.sock.ttrpc"),
		filepath.Join(dir, "debug.sock"), filepath.Join(dir, "opt"), PauseImage,
		strings.Join(quoted, ", "), filepath.Join(dir, "runc"), cniBin, cniConf)
}

// writeCNIConfig writes the pod network: a bridge (bridge, no address on
// the host, no gateway, no masquerade, no route out) with host-local
// addresses from subnet, stored under ipamDir. The CRI plugin cannot do
// with loopback alone: it wants an address on the pod's eth0.
func writeCNIConfig(confDir, bridge, subnet, ipamDir string) error {
	conf := map[string]any{
		"cniVersion": "1.0.0",
		"name":       "mgpu-k8s",
		"plugins": []any{map[string]any{
			"type":             "bridge",
			"bridge":           bridge,
			"isGateway":        false,
			"isDefaultGateway": false,
			"ipMasq":           false,
			"hairpinMode":      false,
			"ipam": map[string]any{
				"type":    "host-local",
				"ranges":  [][]map[string]string{{{"subnet": subnet}}},
				"dataDir": ipamDir,
			},
		}},
	}
	data, err := json.MarshalIndent(conf, "", "  ")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(confDir, 0o755); err != nil { //nolint:gosec // read by containerd only
		return err
	}
	return os.WriteFile(filepath.Join(confDir, "10-mgpu-k8s.conflist"), data, 0o644) //nolint:gosec // not secret
}

// ctr runs ctr against the cluster's containerd in the CRI namespace and
// returns its standard output.
func (c *Cluster) ctr(timeout time.Duration, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	all := append([]string{"--address", c.ContainerdAddress, "--namespace", criNamespace}, args...)
	cmd := exec.CommandContext(ctx, filepath.Join(c.bins.Containerd, "ctr"), all...) //nolint:gosec // the cached build
	var stderr strings.Builder
	cmd.Stderr = &stderr // ctr warns there (cgroup v1 deprecation)
	out, err := cmd.Output()
	if err != nil {
		return string(out), fmt.Errorf("ctr %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()+string(out)))
	}
	return string(out), nil
}

// removeContainers kills and removes every container (pod sandboxes
// included) the CRI plugin made.
func (c *Cluster) removeContainers() error {
	out, err := c.ctr(30*time.Second, "containers", "ls", "-q")
	if err != nil {
		return err
	}
	var errs []string
	for _, id := range strings.Fields(out) {
		_, _ = c.ctr(30*time.Second, "tasks", "kill", "-s", "SIGKILL", id)
		_, _ = c.ctr(30*time.Second, "tasks", "rm", "-f", id)
		if _, err := c.ctr(30*time.Second, "containers", "rm", id); err != nil {
			errs = append(errs, err.Error())
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("k8s: remove containers: %s", strings.Join(errs, "; "))
	}
	return nil
}
