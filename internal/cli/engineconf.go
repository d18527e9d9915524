package cli

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/mgpu-dev/mgpu/cdi/engine"
	"github.com/mgpu-dev/mgpu/internal/fsutil"
)

// The engine step of node install (the chart's runtime.configure, for
// containerd 1.7 and Docker, which read CDI specs only once configured):
// node install configures the engine as mgpu-cli runtime configure does,
// records what each file held before, and restarts the engine only when a
// file changed; node uninstall, and node install with the step turned off,
// put back every file that still holds what the step wrote, and restart the
// engine again. A file changed by someone else since is kept and named.
// The engine's files are reached at their own paths: the chart mounts their
// directories at the same paths in the container.

// engineRecordName is the record's file in the install directory.
const engineRecordName = "engine-record.json"

// engineRecord is what the step changed: enough to put it back.
type engineRecord struct {
	Engine string         `json:"engine"`
	Files  []recordedFile `json:"files"`
	// RestartPending: the files changed and the engine's restart has not
	// succeeded yet (it is tried again by the next install or uninstall).
	RestartPending bool `json:"restart_pending,omitempty"`
	// Reverted: the files were put back; only the restart is left.
	Reverted bool `json:"reverted,omitempty"`
}

type recordedFile struct {
	Path string `json:"path"`
	// Existed says whether the file was there before; Original is what it
	// held then, Mode its mode.
	Existed  bool        `json:"existed"`
	Original []byte      `json:"original,omitempty"`
	Mode     fs.FileMode `json:"mode"`
	// Written is the sha256 of what the step last wrote.
	Written string `json:"written_sha256"`
}

// engineStep is the step's settings (node install's and uninstall's flags).
type engineStep struct {
	engine            string // "", "containerd" or "docker"
	containerdVersion string
	configFile        string
	dropIn            string
	specDirs          []string
	restart           []string // the restart command, run in restartRoot; none: the operator restarts
	restartRoot       string
}

func sha256Hex(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

func (in *installer) recordPath() string {
	return in.host(filepath.Join(in.installDir, engineRecordName))
}

// loadEngineRecord returns the record, or nil when there is none.
func (in *installer) loadEngineRecord() (*engineRecord, error) {
	data, err := os.ReadFile(in.recordPath())
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var r engineRecord
	if err := json.Unmarshal(data, &r); err != nil {
		return nil, fmt.Errorf("%s: %w (remove it to forget what was configured)", in.recordPath(), err)
	}
	return &r, nil
}

func (in *installer) saveEngineRecord(r *engineRecord) error {
	data, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(in.recordPath()), 0o755); err != nil { //nolint:gosec // the install directory
		return err
	}
	return fsutil.WriteFileAtomic(in.recordPath(), append(data, '\n'), 0o600)
}

// plan computes the engine's configuration.
func (s engineStep) plan() (engine.Plan, error) {
	switch s.engine {
	case "containerd":
		return engine.Containerd(engine.ContainerdOptions{Config: s.configFile, DropIn: s.dropIn, Version: s.containerdVersion, SpecDirs: s.specDirs})
	case "docker":
		return engine.Docker(s.configFile, s.specDirs)
	}
	return nil, usagef("unknown --engine %q (want containerd or docker)", s.engine)
}

// configureEngine applies the step (or, turned off, reverts what an earlier
// install configured).
func (in *installer) configureEngine(ctx context.Context, s engineStep) error {
	rec, err := in.loadEngineRecord()
	if err != nil {
		return err
	}
	if rec != nil && (rec.Engine != s.engine || rec.Reverted) {
		// Turned off, another engine, or a revert whose restart failed:
		// finish putting the old configuration back first.
		if err := in.revertEngine(ctx, s, rec); err != nil {
			return err
		}
		rec = nil
	}
	if s.engine == "" {
		return nil
	}
	plan, err := s.plan()
	if err != nil {
		return err
	}
	if rec == nil {
		rec = &engineRecord{Engine: s.engine}
	}
	changed := false
	for _, ch := range plan {
		if !ch.Changed() {
			continue
		}
		i := slices.IndexFunc(rec.Files, func(f recordedFile) bool { return f.Path == ch.Path })
		if i < 0 {
			rec.Files = append(rec.Files, recordedFile{Path: ch.Path, Existed: ch.Old != nil, Original: ch.Old, Mode: ch.Mode})
			i = len(rec.Files) - 1
		}
		rec.Files[i].Written = sha256Hex(ch.New)
		changed = true
	}
	if len(rec.Files) == 0 {
		in.say("%s reads CDI specs already (nothing changed, nothing recorded)", s.engine)
		return nil
	}
	if changed {
		rec.RestartPending = true
		// The record first: whatever is written after it can be put back.
		if err := in.saveEngineRecord(rec); err != nil {
			return err
		}
		if err := plan.Apply(); err != nil {
			return err
		}
		for _, ch := range plan {
			if ch.Changed() {
				in.say("configured %s: %s (%s)", s.engine, ch.Path, ch.Why)
			}
		}
	}
	if !rec.RestartPending {
		in.say("%s: configured already, not restarted", s.engine)
		return nil
	}
	if err := in.restartEngine(ctx, s, rec.Engine); err != nil {
		return err
	}
	rec.RestartPending = false
	return in.saveEngineRecord(rec)
}

// revertEngine puts back the files rec names that still hold what the step
// wrote, restarts the engine when a file changed (or a restart is still
// pending), and removes the record. A failed restart keeps the record,
// marked reverted, so that the next install or uninstall tries it again.
func (in *installer) revertEngine(ctx context.Context, s engineStep, rec *engineRecord) error {
	if !rec.Reverted {
		restored := false
		// Backwards: containerd's main config drops the import before
		// the drop-in goes.
		for i := len(rec.Files) - 1; i >= 0; i-- {
			f := rec.Files[i]
			cur, err := os.ReadFile(f.Path)
			switch {
			case errors.Is(err, fs.ErrNotExist):
				in.say("%s is gone: nothing to put back", f.Path)
				continue
			case err != nil:
				return fmt.Errorf("put back %s: %w", f.Path, fsutil.UnwrapPath(err))
			case sha256Hex(cur) != f.Written:
				in.say("kept %s: it changed since node install configured %s; remove mgpu's CDI settings by hand", f.Path, rec.Engine)
				continue
			}
			if f.Existed {
				if err := fsutil.WriteFileAtomic(f.Path, f.Original, f.Mode); err != nil {
					return err
				}
				in.say("put back %s as it was before node install", f.Path)
			} else {
				if err := os.Remove(f.Path); err != nil && !errors.Is(err, fs.ErrNotExist) {
					return fmt.Errorf("remove %s: %w", f.Path, fsutil.UnwrapPath(err))
				}
				in.say("removed %s (node install created it)", f.Path)
			}
			restored = true
		}
		rec.Reverted = true
		rec.RestartPending = rec.RestartPending || restored
		if rec.RestartPending {
			if err := in.saveEngineRecord(rec); err != nil {
				return err
			}
		}
	}
	if rec.RestartPending {
		if err := in.restartEngine(ctx, s, rec.Engine); err != nil {
			return err
		}
	}
	if err := os.Remove(in.recordPath()); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// restartEngine runs the restart command in the host's root; without a
// command it says what to do.
func (in *installer) restartEngine(ctx context.Context, s engineStep, name string) error {
	if len(s.restart) == 0 {
		in.say("restart %s to apply: systemctl restart %s", name, name)
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, s.restart[0], s.restart[1:]...) //nolint:gosec // the operator's command
	cmd.Dir = "/"
	cmd.Env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
	if s.restartRoot != "" && s.restartRoot != "/" {
		cmd.SysProcAttr = &syscall.SysProcAttr{Chroot: s.restartRoot}
	}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("restart %s (%s, in %s): %w: %s; it is tried again at the next node install or uninstall",
			name, strings.Join(s.restart, " "), s.restartRoot, err, strings.TrimSpace(out.String()))
	}
	in.say("restarted %s (%s)", name, strings.Join(s.restart, " "))
	return nil
}

// engineFlags are node install's and node uninstall's flags of the step.
func engineFlags(install bool) []cli.Flag {
	restart := []cli.Flag{
		&cli.StringFlag{Name: "engine-restart", Usage: "the `COMMAND` (split at spaces) that restarts the engine after its files changed, run with --engine-restart-root as its root (without it, the operator restarts the engine)"},
		&cli.StringFlag{Name: "engine-restart-root", Value: "/", Usage: "the host's root file system as mounted here (`DIR`), where --engine-restart runs"},
	}
	if !install {
		return restart
	}
	return append([]cli.Flag{
		&cli.StringFlag{Name: "engine", Usage: "configure `ENGINE` (containerd or docker) to read CDI specs, recorded so that node uninstall puts it back; without it, an earlier install's configuration is put back"},
		&cli.StringFlag{Name: "containerd-version", Value: engine.Containerd2, Usage: "with --engine containerd: `VERSION` 2 or 1.7"},
		&cli.StringFlag{Name: "engine-config", Usage: "the engine's configuration `FILE` (default " + engine.ContainerdConfig + " or " + engine.DockerConfig + ")"},
		&cli.StringFlag{Name: "containerd-drop-in", Value: engine.ContainerdDropIn, Usage: "with --engine containerd: the drop-in `FILE` to write and import"},
	}, restart...)
}

// engineStepOf reads the step's flags.
func engineStepOf(c *cli.Context, specDirs []string) (engineStep, error) {
	s := engineStep{restart: strings.Fields(c.String("engine-restart")), restartRoot: c.String("engine-restart-root"), specDirs: specDirs}
	if !filepath.IsAbs(s.restartRoot) {
		return s, usagef("--engine-restart-root %q: want an absolute path", s.restartRoot)
	}
	if c.Command.Name != "install" {
		return s, nil
	}
	s.engine, s.containerdVersion = c.String("engine"), c.String("containerd-version")
	s.configFile, s.dropIn = c.String("engine-config"), c.String("containerd-drop-in")
	switch s.engine {
	case "", "docker":
	case "containerd":
		if s.containerdVersion != engine.Containerd2 && s.containerdVersion != engine.Containerd17 {
			return s, usagef("unknown --containerd-version %q (want %s or %s)", s.containerdVersion, engine.Containerd2, engine.Containerd17)
		}
	default:
		return s, usagef("unknown --engine %q (want containerd or docker)", s.engine)
	}
	if s.configFile != "" && !filepath.IsAbs(s.configFile) {
		return s, usagef("--engine-config %q: want an absolute path", s.configFile)
	}
	return s, nil
}
