package cli

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/urfave/cli/v2"
	specs "tags.cncf.io/container-device-interface/specs-go"

	"github.com/mgpu-dev/mgpu/cdi"
	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/internal/device"
	"github.com/mgpu-dev/mgpu/internal/fsutil"
)

func cdiGenerate(c *cli.Context) error {
	if c.NArg() > 0 {
		return usagef("cdi generate takes no arguments, got %q", c.Args().First())
	}
	cfg, err := loadConfig(c)
	if err != nil {
		return err
	}
	if c.IsSet("kind") {
		cfg.CDIKind = c.String("kind")
		if v, cl, ok := strings.Cut(cfg.CDIKind, "/"); !ok || v == "" || cl == "" || strings.Contains(cl, "/") {
			return usagef("--kind must be vendor/class, e.g. %q, got %q", config.DefaultCDIKind, cfg.CDIKind)
		}
	}
	output, format, err := specOutput(c, cfg)
	if err != nil {
		return err
	}

	b, err := device.Open(cfg)
	if err != nil {
		return err
	}
	defer func() { _ = b.Close() }()
	devs, err := b.Devices()
	if err != nil {
		return err
	}
	var opts []cdi.Option
	if c.Bool("no-hooks") {
		opts = append(opts, cdi.WithoutHooks())
	}
	if p := cfg.Path(); p != "" {
		if abs, err := filepath.Abs(p); err == nil {
			opts = append(opts, cdi.WithConfigPath(abs))
		}
	}
	spec, err := cdi.Generate(cfg, devs, b.ControlNodes(), opts...)
	if err != nil {
		return err
	}

	if output == "-" {
		data, err := cdi.Marshal(spec, format)
		if err != nil {
			return err
		}
		if err := cdi.Validate(data, format); err != nil {
			return err
		}
		_, err = c.App.Writer.Write(data)
		return err
	}

	// What the spec refers to on the host, so that it applies as written.
	if cfg.Backend == config.BackendSim {
		if _, err := device.EnsureSimNodes(cfg); err != nil {
			return err
		}
	}
	if err := ensurePreload(cfg, c.App.ErrWriter); err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(output), 0o755); err != nil { //nolint:gosec // engines read spec directories
		return fmt.Errorf("write %s: %w", output, err)
	}
	if err := cdi.WriteFile(output, spec); err != nil {
		return err
	}
	hooks := "with hooks"
	if c.Bool("no-hooks") {
		hooks = "without hooks (--no-hooks)"
	}
	_, err = fmt.Fprintf(c.App.Writer, "wrote %s: %s, %d GPU(s) as %s=0..%d, by UUID and %s=all, cdiVersion %s, %s\n",
		output, cfg.CDIKind, len(devs), cfg.CDIKind, len(devs)-1, cfg.CDIKind, spec.Version, hooks)
	return err
}

// specOutput resolves --output and --format. Engines load only *.yaml and
// *.json from spec directories, so a file must carry the format's extension.
func specOutput(c *cli.Context, cfg *config.Config) (output, format string, err error) {
	format = c.String("format")
	if format != cdi.FormatYAML && format != cdi.FormatJSON {
		return "", "", usagef("unknown --format %q (want yaml or json)", format)
	}
	output = c.String("output")
	switch output {
	case "":
		return filepath.Join(cfg.CDISpecDir, cdi.SpecFileName(cfg.CDIKind, format)), format, nil
	case "-":
		return output, format, nil
	}
	ext := strings.TrimPrefix(filepath.Ext(output), ".")
	if ext != cdi.FormatYAML && ext != cdi.FormatJSON {
		return "", "", usagef("--output %q: a CDI spec file must end in .yaml or .json (engines ignore other files)", output)
	}
	if c.IsSet("format") && ext != format {
		return "", "", usagef("--output %q does not match --format %s", output, format)
	}
	return output, ext, nil
}

// ensurePreload writes the file mounted at /etc/ld.so.preload when it is
// missing (packages ship it); a file with other contents is reported and
// left alone.
func ensurePreload(cfg *config.Config, stderr io.Writer) error {
	p, want := cdi.PreloadPath(cfg), cdi.PreloadContent(cfg)
	got, err := os.ReadFile(p) //nolint:gosec // the installation prefix is the operator's
	switch {
	case err == nil:
		if !bytes.Equal(got, want) {
			fmt.Fprintf(stderr, "mgpu: warning: %s does not name %s; containers will not preload the shim from it\n", p, cdi.ShimPath(cfg))
		}
		return nil
	case errors.Is(err, os.ErrNotExist):
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil { //nolint:gosec // library directory
			return fmt.Errorf("write %s: %w", p, err)
		}
		return fsutil.WriteFileAtomic(p, want, 0o644)
	default:
		return fmt.Errorf("read %s: %w", p, err)
	}
}

func cdiList(c *cli.Context) error {
	format, err := outputFormat(c)
	if err != nil {
		return err
	}
	kind := c.String("kind")
	if !c.IsSet("kind") {
		cfg, err := loadConfig(c)
		switch {
		case err == nil:
			kind = cfg.CDIKind
		case errors.Is(err, config.ErrNotFound) && !c.IsSet("config"):
			kind = config.DefaultCDIKind
		default:
			return err
		}
	}
	dirs := c.StringSlice("spec-dir")
	reg := cdi.Open(dirs...)
	for _, e := range reg.Errors() {
		fmt.Fprintf(c.App.ErrWriter, "mgpu: warning: %s\n", e)
	}
	var devs []cdi.Resolved
	if c.NArg() > 0 {
		if devs, err = reg.Lookup(kind, c.Args().Slice()...); err != nil {
			return usageError{err}
		}
	} else {
		devs = reg.Devices(kind)
	}
	if len(devs) == 0 {
		return fmt.Errorf("no %s devices in %s (run mgpu-cli cdi generate)", kind, strings.Join(dirs, ", "))
	}
	if format == "json" {
		return writeJSON(c.App.Writer, devs)
	}
	return writeResolved(c.App.Writer, devs)
}

func writeResolved(w io.Writer, devs []cdi.Resolved) error {
	var b strings.Builder
	for i, d := range devs {
		if i > 0 {
			b.WriteString("\n")
		}
		fmt.Fprintf(&b, "%s  (%s)\n", d.Name, d.Spec)
		for _, row := range editRows(d.Edits) {
			fmt.Fprintf(&b, "  %-6s %s\n", row[0], row[1])
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func editRows(e specs.ContainerEdits) [][2]string {
	var rows [][2]string
	for _, n := range e.DeviceNodes {
		s := n.Path
		var detail []string
		if n.HostPath != "" {
			detail = append(detail, "host "+n.HostPath)
		}
		if n.Type != "" {
			detail = append(detail, fmt.Sprintf("%s %d:%d", n.Type, n.Major, n.Minor))
		} else {
			detail = append(detail, "numbers from the host node")
		}
		rows = append(rows, [2]string{"node", s + " (" + strings.Join(detail, ", ") + ")"})
	}
	for _, m := range e.Mounts {
		s := m.ContainerPath
		if m.HostPath != m.ContainerPath {
			s += " <- " + m.HostPath
		}
		rows = append(rows, [2]string{"mount", s + " (" + strings.Join(m.Options, ",") + ")"})
	}
	for _, v := range e.Env {
		rows = append(rows, [2]string{"env", v})
	}
	for _, h := range e.Hooks {
		s := h.HookName + ": " + h.Path
		if len(h.Args) > 1 {
			s += " " + strings.Join(h.Args[1:], " ")
		}
		if h.Timeout != nil {
			s += fmt.Sprintf(" (timeout %ds)", *h.Timeout)
		}
		if len(h.Env) > 0 {
			s += " env " + strings.Join(h.Env, " ")
		}
		rows = append(rows, [2]string{"hook", s})
	}
	return rows
}

func init() {
	commands = append(commands, &cli.Command{
		Name:  "cdi",
		Usage: "write and inspect mgpu's CDI spec",
		Subcommands: []*cli.Command{
			{
				Name:      "generate",
				Usage:     "write the CDI spec of the node's GPUs",
				UsageText: "mgpu-cli cdi generate [--output FILE|-] [--format yaml|json] [--kind vendor/class] [--no-hooks]",
				Description: "Writes the spec (atomically, mode 0644) after validating it with the CDI library.\n" +
					"Devices: one per GPU index (0, 1, ...), one per UUID (GPU-...), and all.\n" +
					"Writing a file also creates what the spec refers to when missing: the sim\n" +
					"backend's device nodes (needs root) and <prefix>/lib/mgpu/ld.so.preload.\n" +
					"--output - prints the spec and changes nothing. See docs/cdi.md.",
				Flags: []cli.Flag{
					&cli.StringFlag{Name: "output", Aliases: []string{"o"}, Usage: "spec `FILE` (.yaml or .json), or - for stdout (default <cdi_spec_dir>/<vendor>-<class>.<format>)"},
					&cli.StringFlag{Name: "format", Value: cdi.FormatYAML, Usage: "`FORMAT`: yaml or json"},
					&cli.StringFlag{Name: "kind", Usage: "CDI kind `VENDOR/CLASS` (default cdi_kind of the config, " + config.DefaultCDIKind + ")"},
					&cli.BoolFlag{Name: "no-hooks", Usage: "leave out the mgpu-hook createRuntime/poststop hooks (testing engines without mgpu-hook)"},
				},
				Action: cdiGenerate,
			},
			{
				Name:      "list",
				Usage:     "list the mgpu devices the CDI library resolves, with their edits",
				UsageText: "mgpu-cli cdi list [--output table|json] [--spec-dir DIR]... [--kind vendor/class] [DEVICE...]",
				Flags: []cli.Flag{
					outputFlag,
					&cli.StringSliceFlag{Name: "spec-dir", Value: cli.NewStringSlice(cdi.DefaultSpecDirs...), Usage: "CDI spec `DIR`, lowest priority first"},
					&cli.StringFlag{Name: "kind", Usage: "CDI kind `VENDOR/CLASS` (default cdi_kind of the config)"},
				},
				Action: cdiList,
			},
		},
	})
}
