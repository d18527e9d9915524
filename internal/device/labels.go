package device

import (
	"fmt"
	"strings"

	"github.com/mgpu-dev/mgpu/internal/config"
)

// Label keys: the second seed's card-model labels, the first seed's policy
// label, and the scheduling mode of the node.
const (
	LabelName     = "aliyun.accelerator/nvidia_name"
	LabelMemory   = "aliyun.accelerator/nvidia_mem"
	LabelCount    = "aliyun.accelerator/nvidia_count"
	LabelPolicy   = "vke.volcengine.com/mgpu-compute-policy"
	LabelSchedule = "vke.node.gpu.schedule"
	// ScheduleMGPU is LabelSchedule's value on an mgpu node.
	ScheduleMGPU = "mgpu"
)

// Label is one node label.
type Label struct{ Key, Value string }

// NodeLabels are the labels of a node whose GPUs are devs (at least one):
// the first GPU's model and memory, the count, and the compute policy the
// GPUs run (the node config's default when they run different ones).
// warning is not empty when the GPUs differ (the labels then describe the
// first, and the default policy).
func NodeLabels(cfg *config.Config, devs []Info) (labels []Label, warning string, err error) {
	if len(devs) == 0 {
		return nil, "", fmt.Errorf("the node has no GPU, so there are no labels")
	}
	first := devs[0]
	for _, d := range devs[1:] {
		if d.Name != first.Name || d.MemoryBytes != first.MemoryBytes {
			warning = fmt.Sprintf("GPUs differ (%q vs %q); labels describe GPU %d", first.Name, d.Name, first.Index)
			break
		}
	}
	pol := cfg.Device(first.Index).ComputePolicy
	for _, d := range devs[1:] {
		if p := cfg.Device(d.Index).ComputePolicy; p != pol {
			if warning != "" {
				warning += "; "
			}
			warning += fmt.Sprintf("GPUs run different compute policies (%s vs %s); the label says the default, %s", pol, p, cfg.Defaults.ComputePolicy)
			pol = cfg.Defaults.ComputePolicy
			break
		}
	}
	return []Label{
		{LabelName, strings.ReplaceAll(first.Name, " ", "-")},
		{LabelMemory, fmt.Sprintf("%dMiB", first.MemoryMiB())},
		{LabelCount, fmt.Sprint(len(devs))},
		{LabelPolicy, pol.String()},
	}, warning, nil
}
