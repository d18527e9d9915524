package deviceplugin

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/mgpu-dev/mgpu/kube/placement"
)

// PlacementLabel is the node label that chooses the placement policy of
// preferred allocations (binpack, spread); absent, the --placement flag's.
const PlacementLabel = "ack.node.gpu.placement"

// DefaultPublishInterval is how often the node's labels and capacity are
// checked and set again (the kubelet may reset capacity on a restart).
const DefaultPublishInterval = 30 * time.Second

// NodePublisher keeps the node object as mgpu describes it: its labels
// (card model, policy, vke.node.gpu.schedule=mgpu) and the capacity
// vke.volcengine.com/mgpu-memory (MiB of all its GPUs), and follows the
// node's placement label.
type NodePublisher struct {
	client    kubernetes.Interface
	node      string
	labels    map[string]string
	memoryMiB uint64
	plugin    *Plugin
	fallback  placement.Policy
	log       *slog.Logger
}

// NewNodePublisher returns the publisher of node: labels to set, memoryMiB
// to publish, and plugin whose placement follows the node's label
// (fallback when it has none).
func NewNodePublisher(client kubernetes.Interface, node string, labels map[string]string, memoryMiB uint64, plugin *Plugin, fallback placement.Policy, log *slog.Logger) *NodePublisher {
	return &NodePublisher{client: client, node: node, labels: maps.Clone(labels), memoryMiB: memoryMiB, plugin: plugin, fallback: fallback, log: log}
}

// Run publishes at once and every interval until ctx ends; failures are
// logged and tried again.
func (n *NodePublisher) Run(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		if err := n.Publish(ctx); err != nil && ctx.Err() == nil {
			n.log.Warn("publishing the node's labels and capacity; trying again", "node", n.node, "err", err, "in", interval)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Publish sets what differs: labels, then the status's capacity; and the
// plugin's placement from the node's label.
func (n *NodePublisher) Publish(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	node, err := n.client.CoreV1().Nodes().Get(ctx, n.node, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("node %s: %w", n.node, err)
	}

	pol := n.fallback
	if v, ok := node.Labels[PlacementLabel]; ok {
		p, err := placement.ParsePolicy(v)
		if err != nil {
			n.log.Warn("the node's placement label is not valid; using the default", "label", PlacementLabel, "value", v, "default", n.fallback.String())
		} else {
			pol = p
		}
	}
	if pol != n.plugin.Policy() {
		n.log.Info("placement", "policy", pol.String())
		n.plugin.SetPolicy(pol)
	}

	change := map[string]string{}
	for _, k := range slices.Sorted(maps.Keys(n.labels)) {
		if node.Labels[k] != n.labels[k] {
			change[k] = n.labels[k]
		}
	}
	if len(change) > 0 {
		patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": change}})
		if _, err := n.client.CoreV1().Nodes().Patch(ctx, n.node, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			return fmt.Errorf("node %s: labels: %w", n.node, err)
		}
		n.log.Info("node labels set", "node", n.node, "labels", change)
	}

	want := strconv.FormatUint(n.memoryMiB, 10)
	if q, ok := node.Status.Capacity[MemoryResourceName]; !ok || q.String() != want {
		patch, _ := json.Marshal(map[string]any{"status": map[string]any{"capacity": map[string]string{MemoryResourceName: want}}})
		if _, err := n.client.CoreV1().Nodes().Patch(ctx, n.node, types.MergePatchType, patch, metav1.PatchOptions{}, "status"); err != nil {
			return fmt.Errorf("node %s: capacity %s: %w", n.node, MemoryResourceName, err)
		}
		n.log.Info("node capacity set", "node", n.node, "resource", MemoryResourceName, "mib", want)
	}
	return nil
}
