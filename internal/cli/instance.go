package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/internal/device"
)

// controlTimeout bounds one call of mgpu-cli to an enforcer.
const controlTimeout = 5 * time.Second

// controlClient returns the client of device index's enforcer.
func controlClient(cfg *config.Config, index int) *api.Client {
	return api.NewClient(api.ControlSocket(cfg.DeviceRunDir(index)))
}

// liveAllocation asks device dev's enforcer what it has allocated; ok is
// false when no enforcer answers.
func liveAllocation(cfg *config.Config, dev device.Info) (Allocation, bool) {
	ctx, cancel := context.WithTimeout(context.Background(), controlTimeout)
	defer cancel()
	r, err := controlClient(cfg, dev.Index).Device(ctx)
	if err != nil {
		return Allocation{}, false
	}
	return Allocation{Instances: r.Instances, CoreSum: r.CoreSum, OfflineSum: r.OfflineCoreSum, Switch: r.OnlineOfflineSwitch,
		MemoryBytes: r.MemoryAllocatedMiB << 20, Live: true}, true
}

// notRunning rewrites a dial failure into one actionable line.
func notRunning(index int, err error) error {
	if errors.Is(err, api.ErrNotRunning) {
		return fmt.Errorf("device %d: the enforcer is not running (start it: systemctl start mgpu-enforcer@%d)", index, index)
	}
	return err
}

func instanceList(c *cli.Context) error {
	format, err := outputFormat(c)
	if err != nil {
		return err
	}
	if c.NArg() > 0 {
		return usagef("instance list takes no arguments, got %q", c.Args().First())
	}
	cfg, devs, err := selectedDevices(c)
	if err != nil {
		return err
	}
	all := []api.Instance{}
	var idle []string
	for _, d := range devs {
		ctx, cancel := context.WithTimeout(c.Context, controlTimeout)
		list, err := controlClient(cfg, d.Index).List(ctx)
		cancel()
		if err != nil {
			if errors.Is(err, api.ErrNotRunning) && !c.IsSet("device") {
				idle = append(idle, fmt.Sprint(d.Index))
				continue
			}
			return notRunning(d.Index, err)
		}
		all = append(all, list...)
	}
	if len(idle) > 0 {
		fmt.Fprintf(c.App.ErrWriter, "mgpu: note: no enforcer runs for device %s\n", strings.Join(idle, ", "))
	}
	if format == "json" {
		return writeJSON(c.App.Writer, all)
	}
	return writeInstances(c.App.Writer, all)
}

func writeInstances(w io.Writer, list []api.Instance) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tCONTAINER\tPOLICY\tCORE\tMEMORY\tPROCESSES\tCREATED")
	for _, in := range list {
		who := in.ContainerID
		if in.Kind == api.KindProcessTree {
			who = fmt.Sprintf("(process tree of pid %d)", in.PID)
		}
		if len(who) > 16 && in.Kind == api.KindContainer {
			who = who[:12] // container ids are long hex strings: the short form
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d MiB\t%d\t%s\n", in.Name, who, in.Policy, in.Core, in.MemoryMiB,
			in.Processes, in.Created.Local().Format(time.DateTime))
	}
	return tw.Flush()
}

func instanceRelease(c *cli.Context) error {
	cid := c.String("container")
	if (c.NArg() == 1) == (cid != "") || c.NArg() > 1 {
		return usagef("say which instance: mgpu-cli instance release mgpuXinstY, or --device X --container ID")
	}
	cfg, err := loadConfig(c)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(c.Context, controlTimeout)
	defer cancel()
	var (
		out api.DestroyResponse
		dev int
	)
	if cid != "" {
		if !c.IsSet("device") {
			return usagef("--container needs --device X")
		}
		dev = c.Int("device")
		out, err = controlClient(cfg, dev).DestroyContainer(ctx, cid)
	} else {
		name := c.Args().First()
		var perr error
		if dev, _, perr = api.ParseInstanceName(name); perr != nil {
			return usageError{perr}
		}
		out, err = controlClient(cfg, dev).Destroy(ctx, name)
	}
	if err != nil {
		return notRunning(dev, err)
	}
	what := out.Name
	if what == "" {
		what = strings.TrimSpace(c.Args().First() + " " + cid)
	}
	if !out.Released {
		_, err = fmt.Fprintf(c.App.Writer, "%s: no such instance (nothing to release)\n", what)
		return err
	}
	_, err = fmt.Fprintf(c.App.Writer, "released %s\n", what)
	return err
}

func init() {
	commands = append(commands, &cli.Command{
		Name:  "instance",
		Usage: "list and release the GPU instances of running enforcers",
		Subcommands: []*cli.Command{{
			Name:      "list",
			Usage:     "list the instances (mgpuXinstY) of every device, or of one",
			UsageText: "mgpu-cli instance list [--device X] [--output table|json]",
			Flags: []cli.Flag{
				&cli.IntFlag{Name: "device", Aliases: []string{"d"}, Usage: "only device `X` (NVML index)"},
				outputFlag,
			},
			Action: instanceList,
		}, {
			Name:      "release",
			Usage:     "release an instance (its processes lose their region's grants)",
			UsageText: "mgpu-cli instance release mgpuXinstY | --device X --container ID",
			Flags: []cli.Flag{
				&cli.IntFlag{Name: "device", Aliases: []string{"d"}, Usage: "device `X` of --container"},
				&cli.StringFlag{Name: "container", Usage: "the instance of container `ID`"},
			},
			Action: instanceRelease,
		}},
	})
}
