package cli

import (
	"context"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/urfave/cli/v2"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"

	"github.com/mgpu-dev/mgpu/internal/version"
	"github.com/mgpu-dev/mgpu/kube/allocview"
	"github.com/mgpu-dev/mgpu/kube/kubeconfig"
)

// kubeClientOf returns the client of the API server that kubeconfig (a
// file, or "") names, as kubectl finds it; tests replace it.
// Only the core group's typed client: mgpu-cli does not link the whole
// clientset (50 MB).
var kubeClientOf = func(path string) (corev1client.CoreV1Interface, error) {
	c, err := kubeconfig.User(path)
	if err != nil {
		return nil, err
	}
	cs, err := corev1client.NewForConfig(c)
	if err != nil {
		return nil, fmt.Errorf("the API server: %w", err)
	}
	return cs, nil
}

// clusterNow is the time staleness is measured against; tests replace it.
var clusterNow = time.Now

// clusterTimeout bounds the requests to the API server.
const clusterTimeout = 30 * time.Second

// staleAfter is the age of a node's published allocation that earns a
// note.
const staleAfter = 5 * time.Minute

// nodeListPage is how many nodes one list request asks for.
const nodeListPage = 500

// clusterNode is one node of `inspect --cluster --output json`: the local
// inspect's report and when the node agent published it.
type clusterNode struct {
	inspectReport
	Updated time.Time `json:"updated"`
	// DRA are the shares of the node's GPUs that DRA claims of mgpu's
	// driver hold (node mode dra), by GPU.
	DRA []draShare `json:"dra_claims,omitempty"`
}

// skippedNode is a node that `inspect --cluster` does not show, and why.
type skippedNode struct {
	Node   string `json:"node"`
	Reason string `json:"reason"`
}

// clusterReport is the allocation table of the cluster's nodes.
type clusterReport struct {
	Nodes        []clusterNode `json:"nodes"`   // by name
	Skipped      []skippedNode `json:"skipped"` // by name
	AllocatedMiB uint64        `json:"allocated_mib"`
	TotalMiB     uint64        `json:"total_mib"`
	notes        []string      // one line each, for stderr
}

// nodeIP is the node's InternalIP, else its first address, else "-".
func nodeIP(n *corev1.Node) string {
	for _, a := range n.Status.Addresses {
		if a.Type == corev1.NodeInternalIP && a.Address != "" {
			return a.Address
		}
	}
	if len(n.Status.Addresses) > 0 && n.Status.Addresses[0].Address != "" {
		return n.Status.Addresses[0].Address
	}
	return "-"
}

// newClusterReport is the report of nodes, staleness measured at now: a
// node without the allocation annotation, or with one that does not decode,
// is skipped with a note.
func newClusterReport(nodes []corev1.Node, now time.Time) clusterReport {
	r := clusterReport{Nodes: []clusterNode{}, Skipped: []skippedNode{}}
	nodes = slices.Clone(nodes)
	slices.SortFunc(nodes, func(a, b corev1.Node) int { return strings.Compare(a.Name, b.Name) })
	for i := range nodes {
		n := &nodes[i]
		name := cell(n.Name)
		v, ok := n.Annotations[allocview.Annotation]
		if !ok {
			r.skip(n.Name, "no mgpu allocation annotation (no mgpu node agent?)",
				fmt.Sprintf("node %s has no mgpu allocation annotation (no mgpu node agent?)", name))
			continue
		}
		a, err := allocview.Decode(v)
		if err != nil {
			reason := fmt.Sprintf("annotation %s: %v", allocview.Annotation, err)
			r.skip(n.Name, reason, fmt.Sprintf("node %s: not shown: %s", name, reason))
			continue
		}
		if age := now.Sub(a.Updated); age > staleAfter {
			r.notes = append(r.notes, fmt.Sprintf("node %s: its allocation was last published %v ago", name, age.Round(time.Second)))
		}
		gpus := make([]inspectGPU, 0, len(a.GPUs))
		for _, g := range a.GPUs {
			gpus = append(gpus, newInspectGPU(g))
		}
		cn := clusterNode{inspectReport: sumReport(n.Name, nodeIP(n), gpus), Updated: a.Updated}
		r.Nodes = append(r.Nodes, cn)
		r.AllocatedMiB += cn.AllocatedMiB
		r.TotalMiB += cn.TotalMiB
	}
	return r
}

func (r *clusterReport) skip(node, reason, note string) {
	r.Skipped = append(r.Skipped, skippedNode{Node: node, Reason: reason})
	r.notes = append(r.notes, note)
}

// clusterNodes reads the node called name, or every node when name is "".
func clusterNodes(ctx context.Context, client corev1client.CoreV1Interface, name string) ([]corev1.Node, error) {
	if name != "" {
		n, err := client.Nodes().Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil, fmt.Errorf("the cluster has no node %q", name)
		}
		if err != nil {
			return nil, fmt.Errorf("reading node %q: %w", name, err)
		}
		return []corev1.Node{*n}, nil
	}
	var nodes []corev1.Node
	opts := metav1.ListOptions{Limit: nodeListPage}
	for {
		l, err := client.Nodes().List(ctx, opts)
		if err != nil {
			return nil, fmt.Errorf("listing the nodes: %w", err)
		}
		nodes = append(nodes, l.Items...)
		if l.Continue == "" {
			return nodes, nil
		}
		opts.Continue = l.Continue
	}
}

// inspectCluster is `inspect --cluster` (and kubectl inspect mgpu): the
// table of every node's allocation as its node agent published it.
func inspectCluster(c *cli.Context) error {
	format, err := outputFormat(c)
	if err != nil {
		return err
	}
	if c.NArg() > 0 {
		name := c.App.Name // kubectl inspect mgpu
		if c.Command != nil && c.Command.Name != "" {
			name = c.Command.Name
		}
		return usagef("%s takes no arguments, got %q", name, c.Args().First())
	}
	for _, f := range []string{"kubeconfig", "node"} {
		if c.IsSet(f) && c.String(f) == "" {
			return usagef("--%s is empty", f)
		}
	}
	client, err := kubeClientOf(c.String("kubeconfig"))
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(c.Context, clusterTimeout)
	defer cancel()
	nodes, err := clusterNodes(ctx, client, c.String("node"))
	if err != nil {
		return err
	}
	r := newClusterReport(nodes, clusterNow())
	if dc, err := draClientOf(c.String("kubeconfig")); err != nil {
		r.notes = append(r.notes, fmt.Sprintf("DRA claims not shown: %v", err))
	} else if shares, err := draShares(ctx, dc); err != nil {
		r.notes = append(r.notes, fmt.Sprintf("DRA claims not shown: %v", err))
	} else {
		for i := range r.Nodes {
			r.Nodes[i].DRA = shares[r.Nodes[i].Node]
		}
	}
	if format == "json" {
		return writeJSON(c.App.Writer, r)
	}
	for _, n := range r.notes {
		fmt.Fprintf(c.App.ErrWriter, "mgpu: note: %s\n", n)
	}
	rows := make([]inspectReport, len(r.Nodes))
	for i, n := range r.Nodes {
		rows[i] = n.inspectReport
	}
	if err := writeInspectTable(c.App.Writer, rows); err != nil {
		return err
	}
	return writeDRATable(c.App.Writer, r.Nodes)
}

// clusterFlags are the flags of inspect --cluster and kubectl inspect mgpu
// beside --output.
var clusterFlags = []cli.Flag{
	&cli.StringFlag{Name: "kubeconfig", Usage: "the kubeconfig `FILE` (default: $KUBECONFIG, else ~/.kube/config, else in-cluster)"},
	&cli.StringFlag{Name: "node", Usage: "show only the node called `NAME`"},
}

// kubectlDescription says what the cluster table shows.
const kubectlDescription = "One row per node whose mgpu node agent publishes its allocation (the Node\n" +
	"annotation " + allocview.Annotation + "): the node's name and InternalIP, then per GPU\n" +
	"the memory allocated to instances' quotas over the GPU's memory, in GiB rounded up,\n" +
	"and the node's sums; the last line sums the cluster. A GPU whose enforcer is not\n" +
	"running shows -/TOTAL; a node without the annotation is left out with a note on\n" +
	"stderr. docs/cli.md explains every column."

// KubectlInspect runs kubectl-inspect-mgpu, the kubectl plugin that
// `kubectl inspect mgpu` runs, with args and returns the process exit
// status: `mgpu-cli inspect --cluster` under kubectl's name.
func KubectlInspect(args []string, stdout, stderr io.Writer) int {
	app := &cli.App{
		Name:            "kubectl inspect mgpu",
		Usage:           "print the GPU memory allocation of the cluster's nodes (ACK's kubectl inspect cgpu)",
		UsageText:       "kubectl inspect mgpu [--output table|json] [--node NAME] [--kubeconfig FILE]",
		Description:     kubectlDescription,
		Version:         version.String(),
		HideVersion:     true,
		Writer:          stdout,
		ErrWriter:       stderr,
		HideHelpCommand: true,
		Flags:           append([]cli.Flag{outputFlag}, clusterFlags...),
		OnUsageError:    usageOnError,
		Action:          inspectCluster,
		ExitErrHandler:  func(*cli.Context, error) {},
	}
	return exitCode(app.Run(args), stderr)
}
