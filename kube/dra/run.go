package dra

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
)

// DefaultKubeletDir is the kubelet's root directory: the driver registers
// in its plugins_registry and serves from plugins/<driver>.
const DefaultKubeletDir = "/var/lib/kubelet"

// DataDir is the driver's directory under the kubelet's root dir.
func DataDir(kubeletDir string) string { return filepath.Join(kubeletDir, "plugins", DriverName) }

// Health tells which GPUs' enforcers answer.
type Health func(ctx context.Context) map[int]bool

// Run serves the driver until ctx ends: it registers with the kubelet
// (the kubelet's plugin watcher finds the registration socket, again after
// its own restarts), serves NodePrepareResources and
// NodeUnprepareResources, publishes the node's ResourceSlice, and polls
// health every interval to taint the GPUs whose enforcer is down.
func (d *Driver) Run(ctx context.Context, client kubernetes.Interface, kubeletDir string, health Health, interval time.Duration) error {
	// The kubelet makes plugins_registry; plugins/<driver> is the
	// driver's own (its checkpoint may be there already).
	for _, dir := range []string{filepath.Join(kubeletDir, "plugins_registry"), DataDir(kubeletDir)} {
		if err := os.MkdirAll(dir, 0o750); err != nil {
			return fmt.Errorf("the DRA driver %s: %w", DriverName, err)
		}
	}
	helper, err := kubeletplugin.Start(ctx, d,
		kubeletplugin.DriverName(DriverName),
		kubeletplugin.KubeClient(client),
		kubeletplugin.NodeName(d.node),
		kubeletplugin.RegistrarDirectoryPath(filepath.Join(kubeletDir, "plugins_registry")),
		kubeletplugin.PluginDataDirectoryPath(DataDir(kubeletDir)),
		kubeletplugin.HealthService(false),
	)
	if err != nil {
		return fmt.Errorf("the DRA driver %s: %w", DriverName, err)
	}
	defer helper.Stop()
	d.SetHealth(health(ctx))
	d.mu.Lock()
	d.publish = func(r resourceslice.DriverResources) error { return helper.PublishResources(ctx, r) }
	d.republish()
	d.mu.Unlock()
	d.log.Info("DRA driver serving", "driver", DriverName, "node", d.node, "dir", DataDir(kubeletDir), "gpus", d.order)
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			d.mu.Lock()
			d.publish = nil
			d.mu.Unlock()
			return nil
		case <-t.C:
			d.SetHealth(health(ctx))
		}
	}
}
