package cli

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/urfave/cli/v2"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/internal/device"
	"github.com/mgpu-dev/mgpu/internal/metrics"
	"github.com/mgpu-dev/mgpu/kube/allocview"
)

// sourceOf returns the enforcer of device index (what inspect and top read
// of it, the metrics exporter's source too); tests replace it.
var sourceOf = func(cfg *config.Config, index int) metrics.Source { return controlClient(cfg, index) }

// enforcerSources returns one source per device of devs, in their order.
func enforcerSources(cfg *config.Config, devs []device.Info) []metrics.Source {
	srcs := make([]metrics.Source, len(devs))
	for i, d := range devs {
		srcs[i] = sourceOf(cfg, d.Index)
	}
	return srcs
}

// deviceSample is what one device's enforcer answered at one moment: its
// device answer (allocview's reading, Err set when it did not answer) and,
// when asked for, its instances and their statistics (empty when Err is
// set).
type deviceSample struct {
	allocview.Reading
	Instances []api.Instance
	Stats     []api.InstanceStats
}

// Running reports whether the device's enforcer answered.
func (d deviceSample) Running() bool { return d.Err == nil }

// NotRunning reports whether no enforcer listens on the device's socket.
func (d deviceSample) NotRunning() bool { return errors.Is(d.Err, api.ErrNotRunning) }

// Problem is the line that says why the enforcer did not answer.
func (d deviceSample) Problem() string {
	if d.NotRunning() {
		return notRunning(d.Info.Index, d.Err).Error()
	}
	return fmt.Sprintf("device %d: %v", d.Info.Index, d.Err)
}

// nodeSample is every device's sample, taken together at At.
type nodeSample struct {
	At      time.Time
	Devices []deviceSample
}

// sampleNode asks the enforcer of every device of devs (srcs, in the same
// order) at once: its device answer and, with instances, its instance list
// and statistics. A device whose enforcer fails has Err set; sampleNode
// itself does not fail.
func sampleNode(ctx context.Context, devs []device.Info, srcs []metrics.Source, instances bool, now func() time.Time) nodeSample {
	s := nodeSample{At: now(), Devices: make([]deviceSample, len(devs))}
	var wg sync.WaitGroup
	for i, d := range devs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.Devices[i] = sampleDevice(ctx, d, srcs[i], instances)
		}()
	}
	wg.Wait()
	return s
}

func sampleDevice(ctx context.Context, d device.Info, src metrics.Source, instances bool) deviceSample {
	ctx, cancel := context.WithTimeout(ctx, controlTimeout)
	defer cancel()
	s := deviceSample{Reading: allocview.ReadDevice(ctx, d, src)}
	if s.Err != nil || !instances {
		return s
	}
	fail := func(err error) deviceSample { return deviceSample{Reading: allocview.Reading{Info: d, Err: err}} }
	var err error
	if s.Instances, err = src.List(ctx); err != nil {
		return fail(err)
	}
	if s.Stats, err = src.Stats(ctx); err != nil {
		return fail(err)
	}
	return s
}

// gib converts MiB to the GiB inspect shows, rounded up: a quota of 1 MiB
// shows as 1, and allocated never exceeds total since both round alike.
func gib(mib uint64) uint64 { return (mib + 1023) / 1024 }

// inspectGPU is one GPU of `mgpu-cli inspect --output json`: allocview's
// GPU (the node agent publishes the same fields) and, when its enforcer did
// not answer, why.
type inspectGPU struct {
	Index        int    `json:"index"`
	UUID         string `json:"uuid"`
	AllocatedMiB uint64 `json:"allocated_mib"`
	TotalMiB     uint64 `json:"total_mib"`
	Instances    int    `json:"instances"`
	Running      bool   `json:"running"`
	Error        string `json:"error,omitempty"` // why running is false
}

func newInspectGPU(g allocview.GPU) inspectGPU {
	return inspectGPU{Index: g.Index, UUID: g.UUID, AllocatedMiB: g.AllocatedMiB, TotalMiB: g.TotalMiB, Instances: g.Instances, Running: g.Running}
}

// inspectReport is a node's allocation table (`mgpu-cli inspect`).
type inspectReport struct {
	Node         string       `json:"node"`
	IP           string       `json:"ip"`
	GPUs         []inspectGPU `json:"gpus"`
	AllocatedMiB uint64       `json:"allocated_mib"` // of the running GPUs
	TotalMiB     uint64       `json:"total_mib"`     // of every GPU
}

// newInspectReport is the report of the local node's sample s: each
// device's allocview GPU, and the problem of those whose enforcer did not
// answer.
func newInspectReport(node, ip string, s nodeSample) inspectReport {
	gpus := make([]inspectGPU, 0, len(s.Devices))
	for _, d := range s.Devices {
		g := newInspectGPU(d.GPU())
		if !d.Running() {
			g.Error = d.Problem()
		}
		gpus = append(gpus, g)
	}
	return sumReport(node, ip, gpus)
}

// sumReport is the report of gpus with their sums.
func sumReport(node, ip string, gpus []inspectGPU) inspectReport {
	r := inspectReport{Node: node, IP: ip, GPUs: gpus}
	for _, g := range gpus {
		r.AllocatedMiB += g.AllocatedMiB
		r.TotalMiB += g.TotalMiB
	}
	return r
}

// writeInspect writes the report in the form of ACK's `kubectl inspect
// cgpu`.
func writeInspect(w io.Writer, r inspectReport) error {
	return writeInspectTable(w, []inspectReport{r})
}

// writeInspectTable writes one row per report, in their order, in the form
// of ACK's `kubectl inspect cgpu`. The GPU columns are those of every index
// any report has, in order; a row without that GPU leaves its cell empty.
// A row's memory column and the summary add up the GPU cells as shown (GiB
// rounded up); the percentage is rounded down.
func writeInspectTable(w io.Writer, rs []inspectReport) error {
	var indexes []int
	for _, r := range rs {
		for _, g := range r.GPUs {
			if !slices.Contains(indexes, g.Index) {
				indexes = append(indexes, g.Index)
			}
		}
	}
	slices.Sort(indexes)
	var table bytes.Buffer
	tw := tabwriter.NewWriter(&table, 0, 0, 2, ' ', 0)
	head := []string{"NAME", "IPADDRESS"}
	for _, i := range indexes {
		head = append(head, fmt.Sprintf("GPU%d(Allocated/Total)", i))
	}
	head = append(head, "GPU Memory(GiB)")
	fmt.Fprintln(tw, strings.Join(head, "\t"))
	var alloc, total uint64
	for _, r := range rs {
		row := []string{cell(r.Node), cell(r.IP)}
		var nodeAlloc, nodeTotal uint64
		for _, i := range indexes {
			k := slices.IndexFunc(r.GPUs, func(g inspectGPU) bool { return g.Index == i })
			if k < 0 {
				row = append(row, "")
				continue
			}
			g := r.GPUs[k]
			a := "-"
			if g.Running {
				a = fmt.Sprint(gib(g.AllocatedMiB))
				nodeAlloc += gib(g.AllocatedMiB)
			}
			nodeTotal += gib(g.TotalMiB)
			row = append(row, fmt.Sprintf("%s/%d", a, gib(g.TotalMiB)))
		}
		row = append(row, fmt.Sprintf("%d/%d", nodeAlloc, nodeTotal))
		fmt.Fprintln(tw, strings.Join(row, "\t"))
		alloc += nodeAlloc
		total += nodeTotal
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	width := 0
	for _, l := range strings.Split(table.String(), "\n") {
		width = max(width, utf8.RuneCountInString(l))
	}
	var percent uint64
	if total > 0 {
		percent = alloc * 100 / total
	}
	fmt.Fprintf(&table, "%s\nAllocated/Total GPU Memory In Cluster:\n%d/%d (%d%%)\n", strings.Repeat("-", width), alloc, total, percent)
	_, err := w.Write(table.Bytes())
	return err
}

// cell is s as one table cell: "-" when empty, characters that are not
// printable or are spaces as "?", so that a name cannot break the table.
func cell(s string) string {
	if s == "" {
		return "-"
	}
	return strings.Map(func(r rune) rune {
		if !unicode.IsPrint(r) || unicode.IsSpace(r) {
			return '?'
		}
		return r
	}, s)
}

// firstIPv4 returns the first IPv4 address, not loopback, of an interface
// that is up, or "-".
func firstIPv4() string {
	ifs, err := net.Interfaces()
	if err != nil {
		return "-"
	}
	for _, ifc := range ifs {
		if ifc.Flags&net.FlagUp == 0 || ifc.Flags&net.FlagLoopback != 0 {
			continue
		}
		addrs, err := ifc.Addrs()
		if err != nil {
			continue
		}
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok {
				if ip := n.IP.To4(); ip != nil && !ip.IsLoopback() {
					return ip.String()
				}
			}
		}
	}
	return "-"
}

func inspect(c *cli.Context) error {
	if c.Bool("cluster") {
		for _, f := range []string{"node-name", "ip"} {
			if c.IsSet(f) {
				return usagef("--%s is the local node's; --cluster shows the nodes the API server lists", f)
			}
		}
		return inspectCluster(c)
	}
	for _, f := range []string{"kubeconfig", "node"} {
		if c.IsSet(f) {
			return usagef("--%s needs --cluster", f)
		}
	}
	format, err := outputFormat(c)
	if err != nil {
		return err
	}
	if c.NArg() > 0 {
		return usagef("inspect takes no arguments, got %q", c.Args().First())
	}
	node, ip := c.String("node-name"), c.String("ip")
	if c.IsSet("node-name") && node == "" {
		return usagef("--node-name is empty")
	}
	if c.IsSet("ip") && ip != "-" && net.ParseIP(ip) == nil {
		return usagef("--ip %q is not an IP address", ip)
	}
	cfg, devs, err := openDevices(c)
	if err != nil {
		return err
	}
	if !c.IsSet("node-name") {
		if node, err = os.Hostname(); err != nil || node == "" {
			node = "-"
		}
	}
	if !c.IsSet("ip") {
		ip = firstIPv4()
	}
	s := sampleNode(c.Context, devs, enforcerSources(cfg, devs), false, time.Now)
	r := newInspectReport(node, ip, s)
	if format == "json" {
		return writeJSON(c.App.Writer, r)
	}
	for _, g := range r.GPUs {
		if !g.Running {
			fmt.Fprintf(c.App.ErrWriter, "mgpu: note: %s\n", g.Error)
		}
	}
	return writeInspect(c.App.Writer, r)
}

// usageOnError makes urfave/cli's flag parsing errors usage errors (exit
// status 2, one line).
func usageOnError(_ *cli.Context, err error, _ bool) error { return usageError{err} }

func init() {
	commands = append(commands, &cli.Command{
		Name:  "inspect",
		Usage: "print the GPU memory allocation of the node, or of the cluster's nodes (ACK's kubectl inspect cgpu)",
		UsageText: "mgpu-cli inspect [--output table|json] [--node-name NAME] [--ip ADDRESS]\n" +
			"mgpu-cli inspect --cluster [--output table|json] [--node NAME] [--kubeconfig FILE]",
		Description: "One row: the node's name and IPv4 address, then per GPU the memory allocated to\n" +
			"instances' quotas over the GPU's memory, in GiB rounded up, and the node's sums.\n" +
			"A GPU whose enforcer is not running shows -/TOTAL. docs/cli.md explains every column.\n\n" +
			"With --cluster (the same as kubectl inspect mgpu):\n" + kubectlDescription,
		Flags: append([]cli.Flag{
			outputFlag,
			&cli.StringFlag{Name: "node-name", Usage: "the `NAME` to show (default: the host name)"},
			&cli.StringFlag{Name: "ip", Usage: "the `ADDRESS` to show (default: the first IPv4 address of an interface that is up)"},
			&cli.BoolFlag{Name: "cluster", Usage: "show every node of the cluster, as its node agent published it on the API server"},
		}, clusterFlags...),
		OnUsageError: usageOnError,
		Action:       inspect,
	})
}
