package cli

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/internal/device"
	"github.com/mgpu-dev/mgpu/internal/metrics"
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

// deviceSample is what one device's enforcer answered at one moment. Err is
// set when it did not answer; the answers are then empty.
type deviceSample struct {
	Info      device.Info
	Err       error
	Device    api.DeviceResponse
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
	s := deviceSample{Info: d}
	fail := func(err error) deviceSample { return deviceSample{Info: d, Err: err} }
	var err error
	if s.Device, err = src.Device(ctx); err != nil {
		return fail(err)
	}
	if !instances {
		return s
	}
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

// inspectGPU is one GPU of `mgpu-cli inspect --output json`.
type inspectGPU struct {
	Index        int    `json:"index"`
	UUID         string `json:"uuid"`
	AllocatedMiB uint64 `json:"allocated_mib"`
	TotalMiB     uint64 `json:"total_mib"`
	Instances    int    `json:"instances"`
	Running      bool   `json:"running"`
	Error        string `json:"error,omitempty"` // why running is false
}

// inspectReport is the node's allocation table (`mgpu-cli inspect`).
type inspectReport struct {
	Node         string       `json:"node"`
	IP           string       `json:"ip"`
	GPUs         []inspectGPU `json:"gpus"`
	AllocatedMiB uint64       `json:"allocated_mib"` // of the running GPUs
	TotalMiB     uint64       `json:"total_mib"`     // of every GPU
}

func newInspectReport(node, ip string, s nodeSample) inspectReport {
	r := inspectReport{Node: node, IP: ip, GPUs: []inspectGPU{}}
	for _, d := range s.Devices {
		g := inspectGPU{Index: d.Info.Index, UUID: d.Info.UUID, TotalMiB: d.Info.MemoryMiB(), Running: d.Running()}
		if d.Running() {
			g.AllocatedMiB = d.Device.MemoryAllocatedMiB
			g.Instances = d.Device.Instances
		} else {
			g.Error = d.Problem()
		}
		r.GPUs = append(r.GPUs, g)
		r.AllocatedMiB += g.AllocatedMiB
		r.TotalMiB += g.TotalMiB
	}
	return r
}

// writeInspect writes the report in the form of ACK's `kubectl inspect
// cgpu`. The node's column and the summary add up the GPU columns as shown
// (GiB rounded up); the percentage is rounded down.
func writeInspect(w io.Writer, r inspectReport) error {
	var table bytes.Buffer
	tw := tabwriter.NewWriter(&table, 0, 0, 2, ' ', 0)
	head := []string{"NAME", "IPADDRESS"}
	row := []string{r.Node, r.IP}
	var alloc, total uint64
	for _, g := range r.GPUs {
		head = append(head, fmt.Sprintf("GPU%d(Allocated/Total)", g.Index))
		a := "-"
		if g.Running {
			a = fmt.Sprint(gib(g.AllocatedMiB))
			alloc += gib(g.AllocatedMiB)
		}
		total += gib(g.TotalMiB)
		row = append(row, fmt.Sprintf("%s/%d", a, gib(g.TotalMiB)))
	}
	head = append(head, "GPU Memory(GiB)")
	row = append(row, fmt.Sprintf("%d/%d", alloc, total))
	fmt.Fprintln(tw, strings.Join(head, "\t"))
	fmt.Fprintln(tw, strings.Join(row, "\t"))
	if err := tw.Flush(); err != nil {
		return err
	}
	width := 0
	for _, l := range strings.Split(table.String(), "\n") {
		width = max(width, len(l))
	}
	var percent uint64
	if total > 0 {
		percent = alloc * 100 / total
	}
	fmt.Fprintf(&table, "%s\nAllocated/Total GPU Memory In Cluster:\n%d/%d (%d%%)\n", strings.Repeat("-", width), alloc, total, percent)
	_, err := w.Write(table.Bytes())
	return err
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
		Name:      "inspect",
		Usage:     "print the node's GPU memory allocation (ACK's kubectl inspect cgpu)",
		UsageText: "mgpu-cli inspect [--output table|json] [--node-name NAME] [--ip ADDRESS]",
		Description: "One row: the node's name and IPv4 address, then per GPU the memory allocated to\n" +
			"instances' quotas over the GPU's memory, in GiB rounded up, and the node's sums.\n" +
			"A GPU whose enforcer is not running shows -/TOTAL. docs/cli.md explains every column.",
		Flags: []cli.Flag{
			outputFlag,
			&cli.StringFlag{Name: "node-name", Usage: "the `NAME` to show (default: the host name)"},
			&cli.StringFlag{Name: "ip", Usage: "the `ADDRESS` to show (default: the first IPv4 address of an interface that is up)"},
		},
		OnUsageError: usageOnError,
		Action:       inspect,
	})
}
