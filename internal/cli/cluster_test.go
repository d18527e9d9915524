package cli

import (
	"bytes"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	resourcev1client "k8s.io/client-go/kubernetes/typed/resource/v1"
	k8stesting "k8s.io/client-go/testing"

	"github.com/mgpu-dev/mgpu/kube/allocview"
	"github.com/mgpu-dev/mgpu/kube/dranames"
)

// gpus15 are four 15 GiB GPUs (the seed's) with alloc GiB allocated each.
func gpus15(alloc ...uint64) []allocview.GPU {
	g := make([]allocview.GPU, len(alloc))
	for i, a := range alloc {
		g[i] = allocview.GPU{Index: i, AllocatedMiB: a << 10, TotalMiB: 15 << 10, Instances: int(a / 3), Running: true}
	}
	return g
}

// fakeNode is a Node with addresses and, unless annotation is "", the
// allocation annotation.
func fakeNode(name, annotation string, addrs ...corev1.NodeAddress) *corev1.Node {
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}, Status: corev1.NodeStatus{Addresses: addrs}}
	if annotation != "" {
		n.Annotations = map[string]string{allocview.Annotation: annotation}
	}
	return n
}

// published is n's annotation value, published at t0 less age.
func published(t *testing.T, age time.Duration, gpus []allocview.GPU) string {
	t.Helper()
	v, err := allocview.Encode(allocview.Node{GPUs: gpus, Updated: t0.Add(-age)})
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func internalIP(ip string) corev1.NodeAddress {
	return corev1.NodeAddress{Type: corev1.NodeInternalIP, Address: ip}
}

// fakeCluster is the seed's two nodes (binpack: 15/15 9/15; spread: 4/15
// on three GPUs), a node with two GPUs of which one has no enforcer, a
// stale one, one without the annotation, one with a broken annotation.
func fakeCluster(t *testing.T) []runtime.Object {
	t.Helper()
	small := []allocview.GPU{
		{Index: 0, UUID: fakeUUID0, AllocatedMiB: 12192, TotalMiB: 81920, Instances: 2, Running: true},
		{Index: 1, UUID: fakeUUID1, TotalMiB: 23028},
	}
	return []runtime.Object{
		fakeNode("cn-shanghai.192.0.2.110", published(t, 30*time.Second, gpus15(4, 4, 0, 4)),
			corev1.NodeAddress{Type: corev1.NodeHostName, Address: "node-110"}, internalIP("192.0.2.110")),
		fakeNode("cn-shanghai.192.0.2.109", published(t, 0, gpus15(15, 9, 0, 0)),
			corev1.NodeAddress{Type: corev1.NodeExternalIP, Address: "203.0.113.9"}, internalIP("192.0.2.109")),
		fakeNode("gpu-node-1", published(t, time.Minute, small), corev1.NodeAddress{Type: corev1.NodeHostName, Address: "gpu-node-1"}),
		fakeNode("gpu-node-2", published(t, 7*time.Minute+3*time.Second+400*time.Millisecond, small[:1])),
		fakeNode("cpu-node", "", internalIP("192.0.2.50")),
		fakeNode("broken-node", `{"gpus":[],"updated":"2026-12-04T20:00:00Z","extra":1}`, internalIP("192.0.2.51")),
	}
}

// useFakeCluster makes the commands read objs from a fake API server, at
// t0; it returns the kubeconfig the commands asked for.
func useFakeCluster(t *testing.T, objs ...runtime.Object) *string {
	t.Helper()
	origClient, origDRA, origNow := kubeClientOf, draClientOf, clusterNow
	var asked string
	cs := fake.NewClientset(objs...)
	kubeClientOf = func(kubeconfig string) (corev1client.CoreV1Interface, error) {
		asked = kubeconfig
		return cs.CoreV1(), nil
	}
	draClientOf = func(string) (resourcev1client.ResourceV1Interface, error) { return cs.ResourceV1(), nil }
	clusterNow = func() time.Time { return t0 }
	t.Cleanup(func() { kubeClientOf, draClientOf, clusterNow = origClient, origDRA, origNow })
	return &asked
}

const clusterNotes = "" +
	"mgpu: note: node broken-node: not shown: annotation mgpu.io/gpu-allocation: invalid GPU allocation: json: unknown field \"extra\"\n" +
	"mgpu: note: node cpu-node has no mgpu allocation annotation (no mgpu node agent?)\n" +
	"mgpu: note: node gpu-node-2: its allocation was last published 7m3s ago\n"

func TestInspectCluster(t *testing.T) {
	kubeconfig := useFakeCluster(t, fakeCluster(t)...)

	out, stderr, code := run(t, "inspect", "--cluster", "--kubeconfig", "/etc/kube/admin.conf")
	if code != 0 {
		t.Fatalf("status %d: %s", code, stderr)
	}
	golden(t, "inspect-cluster.txt", out)
	if stderr != clusterNotes {
		t.Errorf("stderr\n%s\nwant\n%s", stderr, clusterNotes)
	}
	if *kubeconfig != "/etc/kube/admin.conf" {
		t.Errorf("kubeconfig %q", *kubeconfig)
	}

	// The plugin is the same command.
	var pout, perr bytes.Buffer
	if code := KubectlInspect([]string{"kubectl-inspect-mgpu"}, &pout, &perr); code != 0 || pout.String() != out || perr.String() != clusterNotes {
		t.Errorf("kubectl inspect mgpu: status %d\n%s%s", code, pout.String(), perr.String())
	}
	if *kubeconfig != "" {
		t.Errorf("kubeconfig %q, want the default", *kubeconfig)
	}

	out, stderr, code = run(t, "inspect", "--cluster", "-o", "json")
	if code != 0 || stderr != "" {
		t.Fatalf("json: status %d: %s", code, stderr)
	}
	golden(t, "inspect-cluster.json", out)
	var r struct {
		Nodes []struct {
			Node, IP     string
			GPUs         []map[string]any
			AllocatedMiB uint64 `json:"allocated_mib"`
			TotalMiB     uint64 `json:"total_mib"`
			Updated      time.Time
		}
		Skipped      []skippedNode
		AllocatedMiB uint64 `json:"allocated_mib"`
		TotalMiB     uint64 `json:"total_mib"`
	}
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatal(err)
	}
	if len(r.Nodes) != 4 || r.Nodes[0].Node != "cn-shanghai.192.0.2.109" || r.Nodes[0].IP != "192.0.2.109" ||
		r.Nodes[2].IP != "gpu-node-1" || r.Nodes[3].IP != "-" || !r.Nodes[3].Updated.Equal(t0.Add(-7*time.Minute-3400*time.Millisecond)) {
		t.Errorf("nodes %+v", r.Nodes)
	}
	if want := uint64(24+12)<<10 + 2*12192; r.AllocatedMiB != want || r.TotalMiB != 8*15<<10+2*81920+23028 {
		t.Errorf("sums %d/%d, want %d", r.AllocatedMiB, r.TotalMiB, want)
	}
	for _, k := range []string{"index", "uuid", "allocated_mib", "total_mib", "instances", "running"} {
		if _, ok := r.Nodes[0].GPUs[0][k]; !ok {
			t.Errorf("no %q in gpus[0]", k)
		}
	}
	if len(r.Skipped) != 2 || r.Skipped[0].Node != "broken-node" || r.Skipped[1] != (skippedNode{"cpu-node", "no mgpu allocation annotation (no mgpu node agent?)"}) {
		t.Errorf("skipped %+v", r.Skipped)
	}
}

// TestInspectClusterOneNode: --node shows that node only.
func TestInspectClusterOneNode(t *testing.T) {
	useFakeCluster(t, fakeCluster(t)...)
	out, stderr, code := run(t, "inspect", "--cluster", "--node", "cn-shanghai.192.0.2.110")
	want := "" +
		"NAME                     IPADDRESS    GPU0(Allocated/Total)  GPU1(Allocated/Total)  GPU2(Allocated/Total)  GPU3(Allocated/Total)  GPU Memory(GiB)\n" +
		"cn-shanghai.192.0.2.110  192.0.2.110  4/15                   4/15                   0/15                   4/15                   12/60\n" +
		strings.Repeat("-", 145) + "\n" +
		"Allocated/Total GPU Memory In Cluster:\n" +
		"12/60 (20%)\n"
	if code != 0 || out != want || stderr != "" {
		t.Errorf("status %d stderr %q\n%s\nwant\n%s", code, stderr, out, want)
	}

	out, stderr, code = run(t, "inspect", "--cluster", "--node", "cpu-node")
	if code != 0 || !strings.HasSuffix(out, "\n0/0 (0%)\n") || stderr != "mgpu: note: node cpu-node has no mgpu allocation annotation (no mgpu node agent?)\n" {
		t.Errorf("status %d stderr %q\n%s", code, stderr, out)
	}

	out, stderr, code = run(t, "inspect", "--cluster", "--node", "gpu-node-9")
	if code != exitFailure || out != "" || stderr != "mgpu: the cluster has no node \"gpu-node-9\"\n" {
		t.Errorf("status %d stdout %q stderr %q", code, out, stderr)
	}
}

// TestInspectClusterNoAgent: without any annotated node, the table is
// empty, 0/0, and every node has its note.
func TestInspectClusterNoAgent(t *testing.T) {
	useFakeCluster(t, fakeNode("b", ""), fakeNode("a", "", internalIP("192.0.2.1")))
	out, stderr, code := run(t, "inspect", "--cluster")
	want := "" +
		"NAME  IPADDRESS  GPU Memory(GiB)\n" +
		strings.Repeat("-", 32) + "\n" +
		"Allocated/Total GPU Memory In Cluster:\n" +
		"0/0 (0%)\n"
	wantErr := "" +
		"mgpu: note: node a has no mgpu allocation annotation (no mgpu node agent?)\n" +
		"mgpu: note: node b has no mgpu allocation annotation (no mgpu node agent?)\n"
	if code != 0 || out != want || stderr != wantErr {
		t.Errorf("status %d\n%s%s\nwant\n%s%s", code, out, stderr, want, wantErr)
	}
	out, stderr, code = run(t, "inspect", "--cluster", "-o", "json")
	if code != 0 || stderr != "" || !strings.HasPrefix(out, "{\n  \"nodes\": [],\n  \"skipped\": [\n") {
		t.Errorf("status %d stderr %q\n%s", code, stderr, out)
	}
}

// TestInspectClusterPages: a cluster listed in pages shows every page.
func TestInspectClusterPages(t *testing.T) {
	page := func(cont string, nodes ...*corev1.Node) *corev1.NodeList {
		l := &corev1.NodeList{ListMeta: metav1.ListMeta{Continue: cont}}
		for _, n := range nodes {
			l.Items = append(l.Items, *n)
		}
		return l
	}
	pages := map[string]*corev1.NodeList{
		"":   page("p2", fakeNode("n2", published(t, 0, gpus15(1)))),
		"p2": page("", fakeNode("n1", published(t, 0, gpus15(2, 3)))),
	}
	var limits []int64
	client := fake.NewClientset()
	client.PrependReactor("list", "nodes", func(a k8stesting.Action) (bool, runtime.Object, error) {
		opts := a.(k8stesting.ListActionImpl).ListOptions
		limits = append(limits, opts.Limit)
		return true, pages[opts.Continue], nil
	})
	orig, origDRA := kubeClientOf, draClientOf
	kubeClientOf = func(string) (corev1client.CoreV1Interface, error) { return client.CoreV1(), nil }
	draClientOf = func(string) (resourcev1client.ResourceV1Interface, error) { return client.ResourceV1(), nil }
	t.Cleanup(func() { kubeClientOf, draClientOf = orig, origDRA })

	out, stderr, code := run(t, "inspect", "--cluster")
	if code != 0 || len(limits) != 2 || limits[0] != nodeListPage || strings.Contains(stderr, "DRA") {
		t.Fatalf("status %d limits %v: %s", code, limits, stderr)
	}
	lines := strings.Split(out, "\n")
	if len(lines) != 7 || lines[1] != "n1    -          2/15                   3/15                   5/30" ||
		lines[2] != "n2    -          1/15                                          1/15" || lines[5] != "6/45 (13%)" {
		t.Errorf("\n%s", out)
	}
}

func TestInspectClusterErrors(t *testing.T) {
	useFakeCluster(t)
	for _, tc := range []struct {
		name   string
		args   []string
		stderr string
	}{
		{"node-name", []string{"--cluster", "--node-name", "a"}, "--node-name is the local node's; --cluster shows the nodes the API server lists"},
		{"ip", []string{"--cluster", "--ip", "192.0.2.1"}, "--ip is the local node's; --cluster shows the nodes the API server lists"},
		{"kubeconfig alone", []string{"--kubeconfig", "k"}, "--kubeconfig needs --cluster"},
		{"node alone", []string{"--node", "a"}, "--node needs --cluster"},
		{"empty node", []string{"--cluster", "--node", ""}, "--node is empty"},
		{"empty kubeconfig", []string{"--cluster", "--kubeconfig", ""}, "--kubeconfig is empty"},
		{"argument", []string{"--cluster", "a"}, `inspect takes no arguments, got "a"`},
		{"bad output", []string{"--cluster", "-o", "yaml"}, `unknown --output "yaml" (want table or json)`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, stderr, code := run(t, append([]string{"inspect"}, tc.args...)...)
			if code != exitUsage || out != "" || stderr != "mgpu: "+tc.stderr+"\n" {
				t.Errorf("status %d stdout %q stderr %q, want %d and %q", code, out, stderr, exitUsage, tc.stderr)
			}
		})
	}

	// No API server: exit 1 with the client's reason.
	kubeClientOf = func(string) (corev1client.CoreV1Interface, error) {
		return nil, errors.New("no API server: set --kubeconfig FILE")
	}
	out, stderr, code := run(t, "inspect", "--cluster")
	if code != exitFailure || out != "" || stderr != "mgpu: no API server: set --kubeconfig FILE\n" {
		t.Errorf("status %d stdout %q stderr %q", code, out, stderr)
	}
	// A failing API server.
	client := fake.NewClientset()
	client.PrependReactor("list", "nodes", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, errors.New(`nodes is forbidden: User "dev" cannot list resource "nodes"`)
	})
	kubeClientOf = func(string) (corev1client.CoreV1Interface, error) { return client.CoreV1(), nil }
	out, stderr, code = run(t, "inspect", "--cluster")
	if code != exitFailure || out != "" || stderr != "mgpu: listing the nodes: nodes is forbidden: User \"dev\" cannot list resource \"nodes\"\n" {
		t.Errorf("status %d stdout %q stderr %q", code, out, stderr)
	}
}

func TestKubectlInspect(t *testing.T) {
	useFakeCluster(t)
	var out, stderr bytes.Buffer
	if code := KubectlInspect([]string{"kubectl-inspect-mgpu", "--help"}, &out, &stderr); code != 0 ||
		!strings.Contains(out.String(), "kubectl inspect mgpu [--output table|json] [--node NAME] [--kubeconfig FILE]") ||
		!strings.Contains(out.String(), allocview.Annotation) || !strings.Contains(out.String(), "--kubeconfig FILE") {
		t.Errorf("help: status %d\n%s%s", code, out.String(), stderr.String())
	}
	for _, tc := range []struct {
		args   []string
		stderr string
	}{
		{[]string{"nodes"}, `kubectl inspect mgpu takes no arguments, got "nodes"`},
		{[]string{"--cluster"}, "flag provided but not defined: -cluster"},
		{[]string{"-o", "wide"}, `unknown --output "wide" (want table or json)`},
	} {
		out.Reset()
		stderr.Reset()
		code := KubectlInspect(append([]string{"kubectl-inspect-mgpu"}, tc.args...), &out, &stderr)
		if code != exitUsage || stderr.String() != "mgpu: "+tc.stderr+"\n" {
			t.Errorf("%v: status %d stdout %q stderr %q", tc.args, code, out.String(), stderr.String())
		}
	}
}

// TestNodeIP: the InternalIP, else the first address, else -.
func TestNodeIP(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		addrs []corev1.NodeAddress
		want  string
	}{
		{nil, "-"},
		{[]corev1.NodeAddress{{Type: corev1.NodeHostName, Address: "h"}, internalIP("192.0.2.1"), internalIP("192.0.2.2")}, "192.0.2.1"},
		{[]corev1.NodeAddress{{Type: corev1.NodeExternalIP, Address: "203.0.113.1"}, {Type: corev1.NodeHostName, Address: "h"}}, "203.0.113.1"},
		{[]corev1.NodeAddress{{Type: corev1.NodeHostName}}, "-"},
	} {
		if got := nodeIP(fakeNode("n", "", tc.addrs...)); got != tc.want {
			t.Errorf("%v: %q, want %q", tc.addrs, got, tc.want)
		}
	}
}

// TestWriteInspectTableCells: a name that is not printable cannot break the
// table.
func TestWriteInspectTableCells(t *testing.T) {
	t.Parallel()
	var b strings.Builder
	if err := writeInspectTable(&b, []inspectReport{{Node: "a\tb\nc", IP: ""}}); err != nil {
		t.Fatal(err)
	}
	if lines := strings.Split(b.String(), "\n"); len(lines) != 6 || lines[1] != "a?b?c  -          0/0" {
		t.Errorf("%q", b.String())
	}
}

// TestInspectClusterDRA: the shares that DRA claims of mgpu's driver hold
// on a node show below the table and in the node's JSON; other drivers'
// and unallocated claims do not.
func TestInspectClusterDRA(t *testing.T) {
	claim := func(ns, name, driver, pool, device, cores, mem string, pods ...string) *resourcev1.ResourceClaim {
		c := &resourcev1.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}
		c.Status.Allocation = &resourcev1.AllocationResult{Devices: resourcev1.DeviceAllocationResult{Results: []resourcev1.DeviceRequestAllocationResult{{
			Request: "gpu", Driver: driver, Pool: pool, Device: device,
			ConsumedCapacity: map[resourcev1.QualifiedName]resource.Quantity{dranames.CapCores: resource.MustParse(cores), dranames.CapMemory: resource.MustParse(mem)},
		}}}}
		for _, p := range pods {
			c.Status.ReservedFor = append(c.Status.ReservedFor, resourcev1.ResourceClaimConsumerReference{Resource: "pods", Name: p, UID: "u-" + types.UID(p)})
		}
		return c
	}
	objs := append(fakeCluster(t),
		claim("ml", "train-gpu-x7k2q", dranames.Driver, "gpu-node-1", "gpu-0", "30", "4Gi", "train"),
		claim("ml", "eval-gpu-q2k9z", dranames.Driver, "gpu-node-1", "gpu-0", "70", "8Gi", "eval"),
		claim("ml", "nic", "nic.example.com", "gpu-node-1", "gpu-0", "1", "1Mi", "train"),
		&resourcev1.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "ml", Name: "pending"}},
	)
	useFakeCluster(t, objs...)
	out, stderr, code := run(t, "inspect", "--cluster")
	if code != 0 || stderr != clusterNotes {
		t.Fatalf("status %d: %s", code, stderr)
	}
	want := "\nDRA claims (gpu.mgpu.io):\n" +
		"NODE        GPU  CLAIM               PODS   CORE  MEMORY(MiB)\n" +
		"gpu-node-1  0    ml/eval-gpu-q2k9z   eval   70%   8192\n" +
		"gpu-node-1  0    ml/train-gpu-x7k2q  train  30%   4096\n"
	if !strings.HasSuffix(out, want) {
		t.Errorf("table ends\n%s\nwant\n%s", out, want)
	}
	out, _, code = run(t, "inspect", "--cluster", "-o", "json")
	if code != 0 {
		t.Fatalf("json: status %d", code)
	}
	var r struct {
		Nodes []struct {
			Node string     `json:"node"`
			DRA  []draShare `json:"dra_claims"`
		}
	}
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatal(err)
	}
	for _, n := range r.Nodes {
		if n.Node == "gpu-node-1" {
			if len(n.DRA) != 2 || n.DRA[1].Claim != "train-gpu-x7k2q" || n.DRA[1].Core != 30 || n.DRA[1].MemoryMiB != 4096 || n.DRA[1].Pods[0] != "train" {
				t.Errorf("gpu-node-1 DRA %+v", n.DRA)
			}
		} else if len(n.DRA) != 0 {
			t.Errorf("%s DRA %+v", n.Node, n.DRA)
		}
	}
}
