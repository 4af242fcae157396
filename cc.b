/dev/fd/3: line 53: ./ok.sh: No such file or directory
B rc=127
