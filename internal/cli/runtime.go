package cli

import (
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/urfave/cli/v2"

	"github.com/mgpu-dev/mgpu/cdi"
	"github.com/mgpu-dev/mgpu/cdi/engine"
	"github.com/mgpu-dev/mgpu/internal/config"
)

const podmanNote = "podman reads CDI specs from /etc/cdi and /var/run/cdi without configuration:\n" +
	"  podman run --device %s=0 ...\n"

func runtimeConfigure(c *cli.Context) error {
	if c.NArg() > 0 {
		return usagef("runtime configure takes no arguments, got %q", c.Args().First())
	}
	rt := c.String("runtime")
	dirs, kind, err := engineSpecDirs(c)
	if err != nil {
		return err
	}
	var plan engine.Plan
	switch rt {
	case "containerd":
		v := c.String("containerd-version")
		if v != engine.Containerd2 && v != engine.Containerd17 {
			return usagef("unknown --containerd-version %q (want %s or %s)", v, engine.Containerd2, engine.Containerd17)
		}
		plan, err = engine.Containerd(engine.ContainerdOptions{
			Config: c.String("config-file"), DropIn: c.String("drop-in"), Version: v, SpecDirs: dirs,
		})
	case "docker":
		plan, err = engine.Docker(c.String("config-file"), dirs)
	case "podman":
		if !slices.Equal(dirs, cdi.DefaultSpecDirs) {
			_, err := fmt.Fprintf(c.App.Writer, "podman reads CDI specs from /etc/cdi and /var/run/cdi only; cdi_spec_dir %s needs\n"+
				"cdi_spec_dirs in containers.conf [engine] (podman 4.5+), see docs/runtime-configure.md\n", dirs[len(dirs)-1])
			return err
		}
		_, err := fmt.Fprintf(c.App.Writer, podmanNote, kind)
		return err
	case "":
		return usagef("say which engine: --runtime containerd, docker or podman")
	default:
		return usagef("unknown --runtime %q (want containerd, docker or podman)", rt)
	}
	if err != nil {
		return err
	}
	if c.Bool("dry-run") {
		return printPlan(c.App.Writer, plan)
	}
	if err := plan.Apply(); err != nil {
		return err
	}
	return reportPlan(c.App.Writer, rt, plan)
}

// engineSpecDirs are the directories the engine must scan: the default
// ones, and the node's cdi_spec_dir when it is another.
func engineSpecDirs(c *cli.Context) ([]string, string, error) {
	cfg, err := loadConfig(c)
	switch {
	case err == nil:
	case errors.Is(err, config.ErrNotFound) && !c.IsSet("config"):
		cfg = config.Default()
	default:
		return nil, "", err
	}
	return specDirsOf(cfg), cfg.CDIKind, nil
}

func printPlan(w io.Writer, plan engine.Plan) error {
	var b strings.Builder
	for _, ch := range plan {
		state := "would be written"
		switch {
		case !ch.Changed():
			state = "unchanged"
		case ch.Old == nil:
			state = "would be created"
		}
		fmt.Fprintf(&b, "# %s (%s: %s)\n", ch.Path, state, ch.Why)
		b.Write(ch.New)
		if len(ch.New) > 0 && ch.New[len(ch.New)-1] != '\n' {
			b.WriteByte('\n')
		}
		b.WriteByte('\n')
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func reportPlan(w io.Writer, rt string, plan engine.Plan) error {
	var b strings.Builder
	for _, ch := range plan {
		switch {
		case !ch.Changed():
			fmt.Fprintf(&b, "%s: already up to date\n", ch.Path)
		case ch.Old == nil:
			fmt.Fprintf(&b, "%s: created (%s)\n", ch.Path, ch.Why)
		default:
			fmt.Fprintf(&b, "%s: updated (%s)\n", ch.Path, ch.Why)
		}
	}
	if plan.Changed() {
		fmt.Fprintf(&b, "restart %s to apply: systemctl restart %s\n", rt, rt)
	} else {
		b.WriteString("nothing changed\n")
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func init() {
	commands = append(commands, &cli.Command{
		Name:  "runtime",
		Usage: "configure container engines for mgpu's CDI devices",
		Subcommands: []*cli.Command{{
			Name:  "configure",
			Usage: "make containerd, Docker or podman read CDI specs",
			UsageText: "mgpu-cli runtime configure --runtime containerd|docker|podman [--config-file PATH] [--drop-in PATH]\n" +
				"    [--containerd-version 2|1.7] [--dry-run]",
			Description: "containerd: writes a drop-in (default " + engine.ContainerdDropIn + ") setting the CRI plugin's\n" +
				"cdi_spec_dirs, and adds it to the imports of the main config (default " + engine.ContainerdConfig + "),\n" +
				"keeping everything else; creates a minimal main config when there is none.\n" +
				"docker: sets features.cdi and cdi-spec-dirs in " + engine.DockerConfig + ", keeping every other key.\n" +
				"podman: nothing to configure. Idempotent; malformed files are reported and left alone.\n" +
				"--config-file names the engine's file (--config is mgpu's node configuration).",
			Flags: []cli.Flag{
				&cli.StringFlag{Name: "runtime", Aliases: []string{"r"}, Usage: "`ENGINE`: containerd, docker or podman"},
				&cli.StringFlag{Name: "config-file", Usage: "the engine's configuration `FILE` (default " + engine.ContainerdConfig + " or " + engine.DockerConfig + ")"},
				&cli.StringFlag{Name: "drop-in", Usage: "containerd drop-in `FILE` (default " + engine.ContainerdDropIn + ")"},
				&cli.StringFlag{Name: "containerd-version", Value: engine.Containerd2, Usage: "`VERSION`: 2 (config version 3 drop-in) or 1.7 (version 2, whole CRI section)"},
				&cli.BoolFlag{Name: "dry-run", Usage: "print the resulting files instead of writing them"},
			},
			Action: runtimeConfigure,
		}},
	})
}
