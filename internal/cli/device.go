package cli

import (
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"

	"github.com/urfave/cli/v2"
	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/internal/device"
	"github.com/mgpu-dev/mgpu/internal/policy"
)

// Allocation is what a device has handed out to instances.
type Allocation struct {
	Instances   int    // number of instances
	CoreSum     int    // sum of the online instances' cores (weights under native-burst-share)
	OfflineSum  int    // sum of the offline instances' cores (weights among them)
	Switch      int    // the online_offline_switch the device runs
	MemoryBytes uint64 // sum of their memory quotas
	Live        bool   // read from the device's running enforcer
}

// allocationOf reports what device dev has allocated. It asks the device's
// enforcer when one runs; without one, nothing is allocated.
var allocationOf = func(cfg *config.Config, dev device.Info) Allocation {
	a, _ := liveAllocation(cfg, dev) // internal/cli/instance.go
	return a
}

// DeviceReport is one device's row set of `mgpu-cli device info`, in the
// seed's field order. docs/cli.md documents each field's meaning in mgpu.
type DeviceReport struct {
	DeviceID                      int    `json:"device_id"`
	ComputeFreeWeight             int    `json:"compute_free_weight"`
	ComputeFreeWeightOnline       int    `json:"compute_free_weight_online"`
	ComputeLoadBalanceMode        int    `json:"compute_load_balance_mode"`
	ComputePolicy                 int    `json:"compute_policy"`
	ComputeQoSEnabled             int    `json:"compute_qos_enabled"`
	ComputeQoSEnabledNativeBurst  int    `json:"compute_qos_enabled_native_burst"`
	ComputeTimeslice              int    `json:"compute_timeslice"`
	ComputeTimesliceNativeBurst   int    `json:"compute_timeslice_native_burst"`
	ComputeTotalWeightNativeBurst int    `json:"compute_total_weight_native_burst"`
	DeviceMajor                   int    `json:"device_major"`
	InstanceDeployMode            int    `json:"instance_deploy_mode"`
	InstanceMajor                 int    `json:"instance_major"`
	OnlineOfflineSwitch           int    `json:"online_offline_switch"`
	UserInstanceMajor             int    `json:"user_instance_major"`
	VmemFreeBytes                 uint64 `json:"vmem_free_bytes"`
	VmemLimit                     string `json:"vmem_limit"`
}

// instanceDeployModeUserSpace: instances are shared-memory regions handed to
// a preloaded shim (mgpu has no kernel module).
const instanceDeployModeUserSpace = 1

// NewDeviceReport computes the report of dev under settings s.
func NewDeviceReport(dev device.Info, s config.DeviceSettings, a Allocation) DeviceReport {
	free := max(0, 100-a.CoreSum-a.OfflineSum)
	freeOnline := max(0, 100-a.CoreSum)
	sw := s.OnlineOfflineSwitch
	if a.Live {
		sw = a.Switch
	}
	var vfree uint64
	if a.MemoryBytes < dev.MemoryBytes {
		vfree = dev.MemoryBytes - a.MemoryBytes
	}
	r := DeviceReport{
		DeviceID:                      dev.Index,
		ComputeFreeWeight:             free,
		ComputeFreeWeightOnline:       freeOnline,
		ComputePolicy:                 s.ComputePolicy.Code(),
		ComputeTimeslice:              s.ComputeTimeslice,
		ComputeTimesliceNativeBurst:   s.ComputeTimesliceNativeBurst,
		ComputeTotalWeightNativeBurst: a.CoreSum + a.OfflineSum,
		OnlineOfflineSwitch:           sw,
		DeviceMajor:                   nodeMajor(dev.Nodes),
		InstanceDeployMode:            instanceDeployModeUserSpace,
		VmemFreeBytes:                 vfree,
		VmemLimit:                     fmt.Sprintf("%d MiB", dev.MemoryMiB()),
	}
	if a.Live {
		r.ComputeQoSEnabled = 1
		if s.ComputePolicy == policy.NativeBurstShare {
			r.ComputeQoSEnabledNativeBurst = 1
		}
	}
	return r
}

// fields returns the report as (name, value) pairs in the seed's order.
func (r DeviceReport) fields() [][2]string {
	i := strconv.Itoa
	return [][2]string{
		{"device_id", i(r.DeviceID)},
		{"compute_free_weight", i(r.ComputeFreeWeight)},
		{"compute_free_weight_online", i(r.ComputeFreeWeightOnline)},
		{"compute_load_balance_mode", i(r.ComputeLoadBalanceMode)},
		{"compute_policy", i(r.ComputePolicy)},
		{"compute_qos_enabled", i(r.ComputeQoSEnabled)},
		{"compute_qos_enabled_native_burst", i(r.ComputeQoSEnabledNativeBurst)},
		{"compute_timeslice", i(r.ComputeTimeslice)},
		{"compute_timeslice_native_burst", i(r.ComputeTimesliceNativeBurst)},
		{"compute_total_weight_native_burst", i(r.ComputeTotalWeightNativeBurst)},
		{"device_major", i(r.DeviceMajor)},
		{"instance_deploy_mode", i(r.InstanceDeployMode)},
		{"instance_major", i(r.InstanceMajor)},
		{"online_offline_switch", i(r.OnlineOfflineSwitch)},
		{"user_instance_major", i(r.UserInstanceMajor)},
		{"vmem_free_bytes", strconv.FormatUint(r.VmemFreeBytes, 10)},
		{"vmem_limit", r.VmemLimit},
	}
}

// writeKV writes the seed's two-column table: a border, then one row and a
// border per field.
func writeKV(w io.Writer, rows [][2]string) error {
	kw, vw := 33, 11
	for _, r := range rows {
		kw = max(kw, len(r[0]))
		vw = max(vw, len(r[1]))
	}
	border := "+" + strings.Repeat("-", kw+2) + "+" + strings.Repeat("-", vw+2) + "+\n"
	var b strings.Builder
	b.WriteString(border)
	for _, r := range rows {
		fmt.Fprintf(&b, "| %-*s | %-*s |\n", kw, r[0], vw, r[1])
		b.WriteString(border)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func nodeMajor(nodes []string) int {
	for _, n := range nodes {
		var st unix.Stat_t
		if err := unix.Stat(n, &st); err == nil && st.Mode&unix.S_IFMT == unix.S_IFCHR {
			return int(unix.Major(st.Rdev)) //nolint:gosec // majors are small
		}
	}
	return 0
}

// outputFlag is the --output flag of listing commands.
var outputFlag = &cli.StringFlag{Name: "output", Aliases: []string{"o"}, Value: "table", Usage: "`FORMAT`: table or json"}

func outputFormat(c *cli.Context) (string, error) {
	switch f := c.String("output"); f {
	case "table", "json":
		return f, nil
	default:
		return "", usagef("unknown --output %q (want table or json)", f)
	}
}

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// openDevices loads the configuration and lists the node's GPUs.
func openDevices(c *cli.Context) (*config.Config, []device.Info, error) {
	cfg, err := loadConfig(c)
	if err != nil {
		return nil, nil, err
	}
	devs, err := device.List(cfg)
	if err != nil {
		return nil, nil, err
	}
	return cfg, devs, nil
}

// selectedDevices is openDevices narrowed to --device X when it is set.
func selectedDevices(c *cli.Context) (*config.Config, []device.Info, error) {
	cfg, devs, err := openDevices(c)
	if err != nil || !c.IsSet("device") {
		return cfg, devs, err
	}
	d, err := device.Find(devs, c.Int("device"))
	if err != nil {
		return nil, nil, usageError{err}
	}
	return cfg, []device.Info{d}, nil
}

func deviceInfo(c *cli.Context) error {
	format, err := outputFormat(c)
	if err != nil {
		return err
	}
	if c.NArg() > 0 {
		return usagef("device info takes no arguments, got %q", c.Args().First())
	}
	if !c.Bool("all") && !c.IsSet("device") {
		return usagef("say which devices: -a for all, or --device X")
	}
	cfg, devs, err := selectedDevices(c)
	if err != nil {
		return err
	}
	reports := make([]DeviceReport, 0, len(devs))
	for _, d := range devs {
		reports = append(reports, NewDeviceReport(d, cfg.Device(d.Index), allocationOf(cfg, d)))
	}
	return writeDeviceReports(c.App.Writer, reports, format)
}

func writeDeviceReports(w io.Writer, reports []DeviceReport, format string) error {
	if format == "json" {
		return writeJSON(w, reports)
	}
	for i, r := range reports {
		if i > 0 {
			if _, err := io.WriteString(w, "\n"); err != nil {
				return err
			}
		}
		if err := writeKV(w, r.fields()); err != nil {
			return err
		}
	}
	return nil
}

func init() {
	commands = append(commands, &cli.Command{
		Name:  "device",
		Usage: "show the node's GPUs",
		Subcommands: []*cli.Command{{
			Name:      "info",
			Usage:     "print each device's sharing state (the mGPU table)",
			UsageText: "mgpu-cli device info -a | --device X [--output table|json]",
			Description: "Prints one table per device with the 17 fields of mGPU's `mgpu-cli device info`:\n" +
				"compute policy (0 fixed-share, 1 guaranteed-burst-share, 2 native-burst-share),\n" +
				"free compute weight, time slices, free device memory, ... Values are live when the\n" +
				"device's enforcer runs. docs/cli.md explains every field.",
			Flags: []cli.Flag{
				&cli.BoolFlag{Name: "all", Aliases: []string{"a"}, Usage: "all devices"},
				&cli.IntFlag{Name: "device", Aliases: []string{"d"}, Usage: "only device `X` (NVML index)"},
				outputFlag,
			},
			Action: deviceInfo,
		}},
	})
}
