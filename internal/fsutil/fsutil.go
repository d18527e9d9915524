// Package fsutil holds file-system helpers shared by mgpu's commands.
package fsutil

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// WriteFileAtomic replaces path with data so that readers see the old or the
// new file, never a partial one: a temporary file in the same directory,
// mode, fsync, rename, fsync of the directory. The temporary name starts
// with "." and ends in neither .json nor .yaml nor .toml, so no directory
// scanner (a CDI cache, an engine's drop-in loader) picks it up. Errors name
// path, never the temporary file.
func WriteFileAtomic(path string, data []byte, mode os.FileMode) error {
	return replace(path, data, mode, true)
}

// ReplaceFile is WriteFileAtomic without the two fsyncs, for a file that
// describes only the current boot: readers, and a writer that restarts,
// see the old or the new file (the page cache is shared), and what a
// machine crash leaves of it (the old file, or a new one cut short)
// describes a boot that has ended. Its readers must treat a file written
// before the current boot as void, whatever it holds. On a node's disk the
// fsyncs cost a create about 1.4 ms, while the engine waits.
func ReplaceFile(path string, data []byte, mode os.FileMode) error {
	return replace(path, data, mode, false)
}

func replace(path string, data []byte, mode os.FileMode, sync bool) error {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp*")
	if err != nil {
		return fmt.Errorf("write %s: %w", path, UnwrapPath(err))
	}
	tmp := f.Name()
	defer func() { _ = os.Remove(tmp) }() // fails harmlessly once renamed
	_, err = f.Write(data)
	if err == nil {
		err = f.Chmod(mode)
	}
	if err == nil && sync {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err == nil && sync {
		err = syncDir(dir)
	}
	if err != nil {
		return fmt.Errorf("write %s: %w", path, UnwrapPath(err))
	}
	return nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir) //nolint:gosec // the directory of a file the caller writes
	if err != nil {
		return err
	}
	defer func() { _ = d.Close() }()
	return d.Sync()
}

// UnwrapPath drops the path of a *PathError or *LinkError: callers name the
// file the operator knows, not a temporary one.
func UnwrapPath(err error) error {
	var pe *os.PathError
	var le *os.LinkError
	switch {
	case errors.As(err, &pe):
		return pe.Err
	case errors.As(err, &le):
		return le.Err
	}
	return err
}
