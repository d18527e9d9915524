package cli

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/urfave/cli/v2"
	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/enforcer/api"
)

// topMaxInterval bounds top's --interval (its usage error says 1h).
const topMaxInterval = time.Hour

// topBarWidth is the number of cells of a share bar; a full bar is 100 %.
const topBarWidth = 10

// topInstance is one instance of a top frame. Percentages are of the
// frame's interval; nil (JSON null) when there is nothing to compare with.
type topInstance struct {
	Name             string   `json:"name"`
	ContainerID      string   `json:"container_id"`
	Namespace        string   `json:"namespace"`
	Pod              string   `json:"pod"`
	Container        string   `json:"container"`
	Claim            string   `json:"claim"` // the DRA ResourceClaim, "" when none
	Core             int      `json:"core"`
	Class            string   `json:"class"` // online or offline
	SharePercent     *float64 `json:"share_percent"`
	MemoryUsedMiB    uint64   `json:"memory_used_mib"`
	MemoryQuotaMiB   uint64   `json:"memory_quota_mib"`
	ThrottledPercent *float64 `json:"throttled_percent"`
	Processes        int      `json:"processes"`

	kind api.Kind
	pid  int
}

// topDevice is one device of a top frame.
type topDevice struct {
	Index              int           `json:"index"`
	Running            bool          `json:"running"`
	Error              string        `json:"error,omitempty"` // why running is false
	Policy             string        `json:"policy"`
	BusyPercent        *float64      `json:"busy_percent"`
	MemoryAllocatedMiB uint64        `json:"memory_allocated_mib"`
	MemoryMiB          uint64        `json:"memory_mib"`
	Instances          []topInstance `json:"instances"`

	notRunning bool // no enforcer listens (not another error)
}

// topFrame is what top shows for two samples of the node: the second one,
// and the rates between them.
type topFrame struct {
	At        string      `json:"at"`         // the second sample, RFC 3339
	IntervalS float64     `json:"interval_s"` // seconds between the samples
	Devices   []topDevice `json:"devices"`

	at   time.Time
	wall time.Duration
}

// rate is delta (ns) as a percentage of wall, rounded to 0.1.
func rate(delta uint64, wall time.Duration) *float64 {
	if wall <= 0 {
		return nil
	}
	p := math.Round(float64(delta)/float64(wall)*1000) / 10
	return &p
}

// grown is how much a cumulative counter grew from prev to cur; a counter
// that went back started again from zero in between.
func grown(prev, cur uint64) uint64 {
	if cur < prev {
		return cur
	}
	return cur - prev
}

func nonNegative(v int64) uint64 {
	if v < 0 {
		return 0
	}
	return uint64(v)
}

// ceilMiB converts bytes to MiB, rounded up.
func ceilMiB(b uint64) uint64 { return b>>20 + min(b&(1<<20-1), 1) }

// newTopFrame computes the frame of cur against the earlier sample prev.
// A counter is compared with prev's value of the same thing: the same
// enforcer (start time and pid) for a device's busy time, the same instance
// (name and creation time) for an instance's. Something that started after
// prev counts from zero; anything else without a value in prev has no rate.
func newTopFrame(prev, cur nodeSample) topFrame {
	wall := cur.At.Sub(prev.At)
	f := topFrame{
		At:        cur.At.Format(time.RFC3339),
		IntervalS: math.Round(wall.Seconds()*1000) / 1000,
		Devices:   []topDevice{},
		at:        cur.At,
		wall:      wall,
	}
	before := make(map[int]deviceSample, len(prev.Devices))
	for _, d := range prev.Devices {
		if d.Running() {
			before[d.Info.Index] = d
		}
	}
	for _, d := range cur.Devices {
		td := topDevice{Index: d.Info.Index, Running: d.Running(), MemoryMiB: d.Info.MemoryMiB(), Instances: []topInstance{}}
		if !d.Running() {
			td.Error, td.notRunning = d.Problem(), d.NotRunning()
			f.Devices = append(f.Devices, td)
			continue
		}
		td.Policy = d.Device.Policy
		td.MemoryAllocatedMiB = d.Device.MemoryAllocatedMiB
		p, hasPrev := before[d.Info.Index]
		switch {
		case hasPrev && p.Device.Started.Equal(d.Device.Started) && p.Device.EnforcerPID == d.Device.EnforcerPID:
			td.BusyPercent = rate(grown(p.Device.BusyNs, d.Device.BusyNs), wall)
		case !d.Device.Started.Before(prev.At):
			td.BusyPercent = rate(d.Device.BusyNs, wall)
		}
		prevInst := make(map[string]api.Instance, len(p.Instances))
		for _, in := range p.Instances {
			prevInst[in.Name] = in
		}
		prevStats := statsByName(p.Stats)
		stats := statsByName(d.Stats)
		for _, in := range d.Instances {
			ti := topInstance{
				Name: in.Name, ContainerID: in.ContainerID, Core: in.Core, Class: cmp.Or(in.Class, "online"),
				MemoryQuotaMiB: in.MemoryMiB, Processes: in.Processes, kind: in.Kind, pid: in.PID,
			}
			if in.Pod != nil {
				ti.Namespace, ti.Pod, ti.Container, ti.Claim = in.Pod.Namespace, in.Pod.Name, in.Pod.Container, in.Pod.Claim
			}
			if st, ok := stats[in.Name]; ok {
				ti.MemoryUsedMiB = ceilMiB(st.MemoryUsedBytes)
				var base api.InstanceStats
				known := !in.Created.Before(prev.At) // created since prev: from zero
				if pin, ok := prevInst[in.Name]; ok && pin.Created.Equal(in.Created) {
					base, known = prevStats[in.Name]
				}
				if known {
					ti.SharePercent = rate(grown(base.GPUNs, st.GPUNs), wall)
					ti.ThrottledPercent = rate(grown(nonNegative(base.DemandThrottledNs), nonNegative(st.DemandThrottledNs)), wall)
				}
			}
			td.Instances = append(td.Instances, ti)
		}
		f.Devices = append(f.Devices, td)
	}
	return f
}

func statsByName(list []api.InstanceStats) map[string]api.InstanceStats {
	m := make(map[string]api.InstanceStats, len(list))
	for _, s := range list {
		m[s.Name] = s
	}
	return m
}

// percent formats a percentage as a whole number, "-" when unknown.
func percent(p *float64) string {
	if p == nil {
		return "-"
	}
	return fmt.Sprintf("%.0f%%", math.Round(*p))
}

// shareBar is [####......]: the share in tenths of 100 %.
func shareBar(p *float64) string {
	n := 0
	if p != nil {
		n = int(math.Round(min(max(*p, 0), 100) / 100 * topBarWidth))
	}
	return "[" + strings.Repeat("#", n) + strings.Repeat(".", topBarWidth-n) + "]"
}

// who names an instance's workload: the pod's container (and its DRA
// claim), or the container id's short form, or the root process of a
// process tree.
func (in topInstance) who() string {
	switch {
	case in.Pod != "" && in.Claim != "":
		return in.Namespace + "/" + in.Pod + "/" + in.Container + " claim " + in.Claim
	case in.Pod != "":
		return in.Namespace + "/" + in.Pod + "/" + in.Container
	case in.kind == api.KindProcessTree:
		return fmt.Sprintf("pid %d", in.pid)
	case len(in.ContainerID) > 12:
		return in.ContainerID[:12]
	default:
		return in.ContainerID
	}
}

// writeTopTable writes frame f as text; hint ends the title line.
func writeTopTable(w io.Writer, f topFrame, hint string) error {
	var b bytes.Buffer
	fmt.Fprintf(&b, "mgpu top  %s  interval %s%s\n\n", f.at.Format(time.DateTime), f.wall.Round(time.Millisecond), hint)
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "GPU\tSTATE\tPOLICY\tBUSY\tMEMORY(MiB)\tINSTANCES")
	var notes []string
	var instances []topInstance
	for _, d := range f.Devices {
		if !d.Running {
			state := "error"
			if d.notRunning {
				state = "not running"
			}
			fmt.Fprintf(tw, "%d\t%s\t-\t-\t-/%d\t-\n", d.Index, state, d.MemoryMiB)
			notes = append(notes, d.Error)
			continue
		}
		fmt.Fprintf(tw, "%d\trunning\t%s\t%s\t%d/%d\t%d\n", d.Index, d.Policy, percent(d.BusyPercent),
			d.MemoryAllocatedMiB, d.MemoryMiB, len(d.Instances))
		instances = append(instances, d.Instances...)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, n := range notes {
		fmt.Fprintf(&b, "%s\n", n)
	}
	b.WriteString("\n")
	if len(instances) == 0 {
		b.WriteString("no instances\n")
	} else {
		fmt.Fprintln(tw, "INSTANCE\tCONTAINER\tCLASS\tCORE\tSHARE\tMEMORY(MiB)\tTHROTTLED\tPROCESSES")
		for _, in := range instances {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d%%\t%s %4s\t%d/%d\t%s\t%d\n", in.Name, in.who(), in.Class, in.Core,
				shareBar(in.SharePercent), percent(in.SharePercent), in.MemoryUsedMiB, in.MemoryQuotaMiB,
				percent(in.ThrottledPercent), in.Processes)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	_, err := w.Write(b.Bytes())
	return err
}

// writeTopFrame writes f in format; later frames of a table follow a blank
// line, JSON frames are one line each.
func writeTopFrame(w io.Writer, f topFrame, format string, later bool) error {
	if format == "json" {
		b, err := json.Marshal(f)
		if err != nil {
			return err
		}
		_, err = w.Write(append(b, '\n'))
		return err
	}
	if later {
		if _, err := io.WriteString(w, "\n"); err != nil {
			return err
		}
	}
	return writeTopTable(w, f, "")
}

// sampler takes one sample of the node.
type sampler func(context.Context) nodeSample

// runTopPlain prints a frame every interval (one with once) until ctx ends.
func runTopPlain(ctx context.Context, w io.Writer, sample sampler, interval time.Duration, once bool, format string) error {
	prev := sample(ctx)
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for n := 0; ; n++ {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
		cur := sample(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if err := writeTopFrame(w, newTopFrame(prev, cur), format, n > 0); err != nil {
			return err
		}
		if once {
			return nil
		}
		prev = cur
	}
}

// isTerminal reports whether f is a terminal.
func isTerminal(f *os.File) bool {
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}

// terminal is the screen top draws on: out, and in (nil when it is not a
// terminal) for keys.
type terminal struct {
	out   *os.File
	in    *os.File
	saved *unix.Termios
}

const (
	altScreenOn  = "\x1b[?1049h"
	altScreenOff = "\x1b[?1049l"
	cursorHide   = "\x1b[?25l"
	cursorShow   = "\x1b[?25h"
	homeClear    = "\x1b[H\x1b[2J"
)

// enter switches to the alternate screen with the cursor hidden, and puts
// the input in cbreak mode: keys arrive one by one, unechoed, and Ctrl-C
// still raises SIGINT.
func (t *terminal) enter() error {
	if t.in != nil {
		fd := int(t.in.Fd())
		saved, err := unix.IoctlGetTermios(fd, unix.TCGETS)
		if err != nil {
			return fmt.Errorf("terminal: %w", err)
		}
		raw := *saved
		raw.Lflag &^= unix.ICANON | unix.ECHO
		raw.Cc[unix.VMIN], raw.Cc[unix.VTIME] = 1, 0
		if err := unix.IoctlSetTermios(fd, unix.TCSETS, &raw); err != nil {
			return fmt.Errorf("terminal: %w", err)
		}
		t.saved = saved
	}
	_, err := io.WriteString(t.out, altScreenOn+cursorHide+homeClear)
	return err
}

// leave undoes enter.
func (t *terminal) leave() {
	_, _ = io.WriteString(t.out, cursorShow+altScreenOff)
	if t.saved != nil {
		_ = unix.IoctlSetTermios(int(t.in.Fd()), unix.TCSETS, t.saved)
	}
}

// draw replaces the screen with text, cut to the terminal's size.
func (t *terminal) draw(text string) error {
	rows, cols := 0, 0
	if ws, err := unix.IoctlGetWinsize(int(t.out.Fd()), unix.TIOCGWINSZ); err == nil {
		rows, cols = int(ws.Row), int(ws.Col)
	}
	_, err := io.WriteString(t.out, homeClear+clip(text, rows, cols))
	return err
}

// clip keeps the first rows lines of text and the first cols characters of
// each (0: no limit), without a newline after the last line so that the
// screen does not scroll.
func clip(text string, rows, cols int) string {
	lines := strings.Split(strings.TrimRight(text, "\n"), "\n")
	if rows > 0 && len(lines) > rows {
		lines = lines[:rows]
	}
	for i, l := range lines {
		if r := []rune(l); cols > 0 && len(r) > cols {
			lines[i] = string(r[:cols])
		}
	}
	return strings.Join(lines, "\n")
}

// readKeys calls quit when q is typed; it returns at the first q or when
// reading fails.
func readKeys(in io.Reader, quit func()) {
	b := make([]byte, 64)
	for {
		n, err := in.Read(b)
		if bytes.ContainsAny(b[:n], "qQ") {
			quit()
			return
		}
		if err != nil {
			return
		}
	}
}

// runTopTerminal redraws the frame in place every interval until q is
// typed, SIGINT or SIGTERM arrives or ctx ends, then restores the terminal.
func runTopTerminal(ctx context.Context, t *terminal, sample sampler, interval time.Duration) error {
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	ctx, quit := context.WithCancel(ctx)
	defer quit()
	if err := t.enter(); err != nil {
		return err
	}
	defer t.leave()
	if t.in != nil {
		go readKeys(t.in, quit)
	}
	winch := make(chan os.Signal, 1)
	signal.Notify(winch, syscall.SIGWINCH)
	defer signal.Stop(winch)

	const hint = "  (q: quit)"
	screen := fmt.Sprintf("mgpu top  sampling every %s ...%s\n", interval, hint)
	if err := t.draw(screen); err != nil {
		return err
	}
	prev := sample(ctx)
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-winch:
		case <-tick.C:
			cur := sample(ctx)
			if ctx.Err() != nil {
				return nil
			}
			var b strings.Builder
			if err := writeTopTable(&b, newTopFrame(prev, cur), hint); err != nil {
				return err
			}
			screen, prev = b.String(), cur
		}
		if err := t.draw(screen); err != nil {
			return err
		}
	}
}

func top(c *cli.Context) error {
	format, err := outputFormat(c)
	if err != nil {
		return err
	}
	if c.NArg() > 0 {
		return usagef("top takes no arguments, got %q", c.Args().First())
	}
	interval := c.Duration("interval")
	if interval <= 0 || interval > topMaxInterval {
		return usagef("--interval %s is out of range (want more than 0 and at most 1h)", interval)
	}
	cfg, devs, err := openDevices(c)
	if err != nil {
		return err
	}
	srcs := enforcerSources(cfg, devs)
	sample := func(ctx context.Context) nodeSample { return sampleNode(ctx, devs, srcs, true, time.Now) }
	if out, ok := c.App.Writer.(*os.File); ok && format == "table" && !c.Bool("once") && isTerminal(out) {
		t := &terminal{out: out}
		if isTerminal(os.Stdin) {
			t.in = os.Stdin
		}
		return runTopTerminal(c.Context, t, sample, interval)
	}
	return runTopPlain(c.Context, c.App.Writer, sample, interval, c.Bool("once"), format)
}

func init() {
	commands = append(commands, &cli.Command{
		Name:      "top",
		Usage:     "show every device's and instance's GPU use, live",
		UsageText: "mgpu-cli top [--interval DURATION] [--once] [--output table|json]",
		Description: "Samples every enforcer, waits --interval, samples again and shows the difference:\n" +
			"per device its busy time and allocated memory, per instance its measured share of\n" +
			"the GPU against its quota, memory used and time throttled. On a terminal the view\n" +
			"redraws in place until q or Ctrl-C; otherwise (or with --output json) one frame\n" +
			"follows another. docs/cli.md explains every column and field.",
		Flags: []cli.Flag{
			&cli.DurationFlag{Name: "interval", Value: time.Second, Usage: "time between samples, `DURATION` (e.g. 500ms, 2s; at most 1h)"},
			&cli.BoolFlag{Name: "once", Usage: "print one frame and exit"},
			outputFlag,
		},
		OnUsageError: usageOnError,
		Action:       top,
	})
}
