package cli

import (
	"context"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"

	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	resourcev1client "k8s.io/client-go/kubernetes/typed/resource/v1"

	"github.com/mgpu-dev/mgpu/kube/dranames"
	"github.com/mgpu-dev/mgpu/kube/kubeconfig"
)

// draClientOf returns the resource.k8s.io/v1 client of the API server that
// kubeconfig names; tests replace it.
var draClientOf = func(path string) (resourcev1client.ResourceV1Interface, error) {
	c, err := kubeconfig.User(path)
	if err != nil {
		return nil, err
	}
	cs, err := resourcev1client.NewForConfig(c)
	if err != nil {
		return nil, fmt.Errorf("the API server: %w", err)
	}
	return cs, nil
}

// draShare is one DRA claim's share of one GPU of a node, as the scheduler
// allocated it (the claim's status).
type draShare struct {
	GPU       int      `json:"gpu"`
	Namespace string   `json:"namespace"`
	Claim     string   `json:"claim"`
	Pods      []string `json:"pods"` // status.reservedFor
	Core      int      `json:"core"`
	MemoryMiB uint64   `json:"memory_mib"`
}

// claimListPage is how many claims one list request asks for.
const claimListPage = 500

// draShares reads the allocated ResourceClaims of mgpu's driver, by node
// (the pool). A cluster that does not serve resource.k8s.io/v1 has none.
func draShares(ctx context.Context, client resourcev1client.ResourceV1Interface) (map[string][]draShare, error) {
	out := map[string][]draShare{}
	opts := metav1.ListOptions{Limit: claimListPage}
	for {
		l, err := client.ResourceClaims("").List(ctx, opts)
		if apierrors.IsNotFound(err) {
			return out, nil
		}
		if err != nil {
			return nil, fmt.Errorf("listing the ResourceClaims: %w", err)
		}
		for i := range l.Items {
			addShares(out, &l.Items[i])
		}
		if l.Continue == "" {
			break
		}
		opts.Continue = l.Continue
	}
	for node := range out {
		slices.SortFunc(out[node], func(a, b draShare) int {
			if a.GPU != b.GPU {
				return a.GPU - b.GPU
			}
			return strings.Compare(a.Namespace+"/"+a.Claim, b.Namespace+"/"+b.Claim)
		})
	}
	return out, nil
}

// addShares adds a claim's shares of mgpu's devices (gpu-<index> of pool
// <node>); results whose device or capacities do not read are left out.
func addShares(out map[string][]draShare, c *resourcev1.ResourceClaim) {
	if c.Status.Allocation == nil {
		return
	}
	var pods []string
	for _, r := range c.Status.ReservedFor {
		if r.Resource == "pods" && r.APIGroup == "" {
			pods = append(pods, r.Name)
		}
	}
	for _, r := range c.Status.Allocation.Devices.Results {
		gpu, ok := dranames.ParseDeviceName(r.Device)
		if r.Driver != dranames.Driver || !ok {
			continue
		}
		cores, mem := r.ConsumedCapacity[dranames.CapCores], r.ConsumedCapacity[dranames.CapMemory]
		core, okc := cores.AsInt64()
		b, okm := mem.AsInt64()
		if !okc || !okm || core < 0 || core > 100 || b < 0 {
			continue
		}
		out[r.Pool] = append(out[r.Pool], draShare{GPU: gpu, Namespace: c.Namespace, Claim: c.Name, Pods: slices.Clone(pods),
			Core: int(core), MemoryMiB: uint64(b) >> 20})
	}
}

// writeDRATable writes the shares of the nodes shown, below the allocation
// table; nothing when there are none.
func writeDRATable(w io.Writer, nodes []clusterNode) error {
	var rows []string
	for _, n := range nodes {
		for _, s := range n.DRA {
			pods := strings.Join(s.Pods, ",")
			if pods == "" {
				pods = "-"
			}
			rows = append(rows, fmt.Sprintf("%s\t%d\t%s/%s\t%s\t%d%%\t%d", cell(n.Node), s.GPU, cell(s.Namespace), cell(s.Claim), cell(pods), s.Core, s.MemoryMiB))
		}
	}
	if len(rows) == 0 {
		return nil
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "\nDRA claims (%s):\n", dranames.Driver)
	fmt.Fprintln(tw, "NODE\tGPU\tCLAIM\tPODS\tCORE\tMEMORY(MiB)")
	for _, r := range rows {
		fmt.Fprintln(tw, r)
	}
	return tw.Flush()
}
