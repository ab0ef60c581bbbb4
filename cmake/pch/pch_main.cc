// The executable host of the precompiled header links, so it has a main.
int main() { return 0; }
