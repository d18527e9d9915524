// Package engine configures container engines to read CDI specs: a
// containerd drop-in imported by the main config, Docker's daemon.json. It
// computes every file's new contents first (Plan), so a dry run prints
// exactly what a real run writes, and a malformed file is reported before
// anything is touched.
package engine

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"

	"github.com/mgpu-dev/mgpu/internal/fsutil"
)

// Change is one file a configuration writes.
type Change struct {
	Path string
	// Old is the file's current contents; nil when it does not exist.
	Old []byte
	New []byte
	// Mode is the file's mode: the existing file's, or 0644 for a new one.
	Mode fs.FileMode
	// Why says what the change does, for the operator.
	Why string
}

// Changed tells whether applying the change writes anything.
func (c Change) Changed() bool { return c.Old == nil || !bytes.Equal(c.Old, c.New) }

// Plan is the set of files a configuration writes, in order.
type Plan []Change

// Changed tells whether applying the plan writes anything.
func (p Plan) Changed() bool {
	for _, c := range p {
		if c.Changed() {
			return true
		}
	}
	return false
}

// Apply writes the changed files, each atomically, in order (a drop-in
// before the file that imports it).
func (p Plan) Apply() error {
	for _, c := range p {
		if !c.Changed() {
			continue
		}
		if err := os.MkdirAll(filepath.Dir(c.Path), 0o755); err != nil { //nolint:gosec // engine configuration directories
			return fmt.Errorf("write %s: %w", c.Path, fsutil.UnwrapPath(err))
		}
		if err := fsutil.WriteFileAtomic(c.Path, c.New, c.Mode); err != nil {
			return err
		}
	}
	return nil
}

// readFile returns the file's contents and mode, or nil and 0644 when it
// does not exist.
func readFile(path string) ([]byte, fs.FileMode, error) {
	data, err := os.ReadFile(path) //nolint:gosec // the path is the operator's choice
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) {
		// Not there (a parent that is a file fails when writing).
		return nil, 0o644, nil
	}
	if err != nil {
		return nil, 0, fmt.Errorf("read %s: %w", path, fsutil.UnwrapPath(err))
	}
	st, err := os.Stat(path)
	if err != nil {
		return nil, 0, fmt.Errorf("read %s: %w", path, fsutil.UnwrapPath(err))
	}
	if data == nil {
		data = []byte{}
	}
	return data, st.Mode().Perm(), nil
}

// lineOf returns the 1-based line of byte offset off in data.
func lineOf(data []byte, off int64) int {
	if off > int64(len(data)) {
		off = int64(len(data))
	}
	return bytes.Count(data[:off], []byte("\n")) + 1
}
