package ociimage

import (
	"debug/elf"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// LibDirs are where Libraries looks for a shared library by name, in
// order: the multiarch and plain library directories of Debian, Ubuntu,
// Fedora and their kin.
var LibDirs = []string{
	"/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu",
	"/lib/aarch64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
	"/lib64", "/usr/lib64", "/lib", "/usr/lib",
}

// Libraries returns the entries that make the host's dynamic executables
// and libraries run in an image: their program interpreter and every
// shared library they need (DT_NEEDED, transitively), each at the path the
// loader looks for it, as the host's file or, where that path is a
// symbolic link, the link and the file it resolves to. A static
// executable needs none. RPATH and RUNPATH are not followed: the loader
// finds these libraries in LibDirs, which is where this looks.
func Libraries(files ...string) ([]Entry, error) {
	seen := map[string]bool{}
	var out []Entry
	add := func(p string) error {
		es, err := hostPath(p)
		if err != nil {
			return err
		}
		for _, e := range es {
			if !seen[e.Path] {
				seen[e.Path] = true
				out = append(out, e)
			}
		}
		return nil
	}
	queue := append([]string(nil), files...)
	done := map[string]bool{}
	for len(queue) > 0 {
		f := queue[0]
		queue = queue[1:]
		if done[f] {
			continue
		}
		done[f] = true
		interp, needed, err := dynamic(f)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", f, err)
		}
		if interp != "" {
			if err := add(interp); err != nil {
				return nil, fmt.Errorf("%s: its interpreter: %w", f, err)
			}
		}
		for _, n := range needed {
			p, err := findLib(n)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", f, err)
			}
			if err := add(p); err != nil {
				return nil, err
			}
			queue = append(queue, p)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Path < out[j].Path })
	return out, nil
}

// dynamic returns an ELF file's interpreter and needed libraries.
func dynamic(p string) (string, []string, error) {
	f, err := elf.Open(p)
	if err != nil {
		return "", nil, err
	}
	defer func() { _ = f.Close() }()
	var interp string
	for _, prog := range f.Progs {
		if prog.Type == elf.PT_INTERP {
			b := make([]byte, prog.Filesz)
			if _, err := prog.ReadAt(b, 0); err != nil {
				return "", nil, err
			}
			for len(b) > 0 && b[len(b)-1] == 0 {
				b = b[:len(b)-1]
			}
			interp = string(b)
		}
	}
	needed, err := f.ImportedLibraries()
	if err != nil && !errors.Is(err, elf.ErrNoSymbols) {
		return "", nil, err
	}
	return interp, needed, nil
}

func findLib(name string) (string, error) {
	if filepath.IsAbs(name) {
		return name, nil
	}
	for _, d := range LibDirs {
		p := filepath.Join(d, name)
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() {
			return p, nil
		}
	}
	return "", fmt.Errorf("needs %s, found in none of %v", name, LibDirs)
}

// hostPath returns the entries that reproduce the host's resolution of
// path p: every symbolic link met on the way (a linked directory such as
// /lib -> usr/lib included) and the regular file it ends at.
func hostPath(p string) ([]Entry, error) {
	var out []Entry
	links := 0
	rest := strings.Split(strings.Trim(filepath.Clean(p), "/"), "/")
	cur := "/"
	for len(rest) > 0 {
		next := filepath.Join(cur, rest[0])
		rest = rest[1:]
		st, err := os.Lstat(next)
		if err != nil {
			return nil, err
		}
		if st.Mode()&os.ModeSymlink == 0 {
			if len(rest) == 0 {
				if !st.Mode().IsRegular() {
					return nil, fmt.Errorf("%s: not a regular file", next)
				}
				return append(out, Entry{Path: next, Src: next, Mode: st.Mode().Perm()}), nil
			}
			cur = next
			continue
		}
		if links++; links > 40 {
			return nil, fmt.Errorf("%s: too many levels of symbolic links", p)
		}
		t, err := os.Readlink(next)
		if err != nil {
			return nil, err
		}
		out = append(out, Entry{Path: next, Link: t})
		if filepath.IsAbs(t) {
			cur = "/"
		}
		rest = append(strings.Split(strings.Trim(filepath.Clean(t), "/"), "/"), rest...)
	}
	return nil, fmt.Errorf("%s: a directory, not a file", p)
}
